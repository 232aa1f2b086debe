"""`mmformer info`: resolved recipe, parameter count, FLOPs per sample (eager path, exact for a tiny model)."""

from pathlib import Path

from mmformer.cli import main

QUICKSTART = Path(__file__).parents[1] / "recipes/image/vit_tiny_classify_mnist5k.yaml"


def test_info_prints_params_and_flops(capsys):
    assert main(["info", str(QUICKSTART)]) == 0
    out = capsys.readouterr().out
    assert "name: vit_tiny_classify_mnist5k" in out
    params = int(out.split("parameters: ")[1].split()[0].replace(",", ""))
    # tokenizer: conv 49·128+128, cls 128, pos 17·128; 4 blocks of 12·128²+13·128 (+norms); head fc_norm + 128·10+10
    block = (128 * 384 + 384) + (128 * 128 + 128) + (128 * 512 + 512) + (512 * 128 + 128) + 4 * 128
    expected = (49 * 128 + 128) + 128 + 17 * 128 + 4 * block + 2 * 128 + 128 * 10 + 10
    assert params == expected
    # Forward FLOPs per sample: 2·(matmul params)·tokens + attention 4·N²·D per layer.
    n, d = 17, 128
    matmul = 2 * n * (128 * 384 + 128 * 128 + 128 * 512 + 512 * 128) * 4 + 2 * 16 * 49 * 128 + 2 * 128 * 10
    attention = 4 * (2 * 2 * n * n * d)  # q·kᵀ and attn·v in each of 4 layers
    line = next(ln for ln in out.splitlines() if ln.startswith("FLOPs per sample"))
    forward_m = float(line.split("forward ")[1].split(" M")[0].replace(",", ""))
    assert abs(forward_m - (matmul + attention) / 1e6) < 0.1
