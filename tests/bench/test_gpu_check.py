"""``bench/gpu_check.py`` runs whole on the CPU at tiny sizes (``--cpu-smoke``) with Lightning, W&B,
OmegaConf and torchmetrics unimportable — as on the lent GPU machine, which lacks them — and its
numbers mean what they say: every variant of the GPT-2 language-model step starts from the same
weights, so eager and compiled first losses agree, at ln V for an untrained model."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("lightning", "pytorch_lightning", "wandb", "omegaconf", "torchmetrics")
RUN = f"""
import runpy, sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # import fails, as on a machine without them
sys.argv = ["gpu_check.py", *sys.argv[1:]]
runpy.run_path("bench/gpu_check.py", run_name="__main__")
"""


def _gpu_check():
    spec = importlib.util.spec_from_file_location("bench_gpu_check", ROOT / "bench" / "gpu_check.py")
    module = sys.modules["bench_gpu_check"] = importlib.util.module_from_spec(spec)  # bench/ is no package
    spec.loader.exec_module(module)
    return module


def test_the_lm_step_flops_are_torchs_flop_count_of_the_same_step():
    """``lm_step_flops`` against ``torch.utils.flop_counter`` over a real step of a small tied-head LM
    with eager attention (whose score and value products the counter sees as matrix products): equal
    once the counter's full-square attention is halved for causal and the parameters that are no
    matrix (biases, norms: 6 FLOPs per token each in the formula) are set apart."""
    from torch.utils.flop_counter import FlopCounterMode

    from mmformer.models import AttentionConfig, MlpConfig, MultimodalModel, build_backbone
    from mmformer.models.heads import LMHead
    from mmformer.tokenizers import TextEmbedding

    d, layers, vocab, batch, n = 64, 2, 1000, 2, 48
    emb, head = TextEmbedding(vocab, d, max_len=n), LMHead(d, vocab)
    head.tie_to(emb.embed)
    backbone = build_backbone(
        d, layers, AttentionConfig(4, kernel="eager"), mlp=MlpConfig(act="gelu_tanh"), causal=True
    )
    model = MultimodalModel({"text": emb}, backbone, {"lm": head})
    ids = torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        hidden, _ = model.encode("text", ids)
        logits = hidden @ emb.embed.weight.T  # the head's product, as the chunked loss computes it
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    tokens = batch * n
    not_matrices = sum(p.numel() for p in backbone.parameters() if p.dim() < 2)
    causal_half = 6 * layers * n * d * tokens
    counted = counter.get_total_flops()
    assert (
        _gpu_check().lm_step_flops(backbone, vocab, batch, n)
        == counted - causal_half + 6 * tokens * not_matrices
    )


@pytest.mark.slow
def test_the_gpu_script_runs_standalone_and_its_variants_share_weights(tmp_path):
    env = {"OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", RUN, "--cpu-smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "errors" not in results, results["errors"]
    flex = results["flex_vs_eager"]  # 6 masks × ALiBi or not × 2 dtypes; BigBird's also through sdpa
    assert len(flex) == 24 and all(v["ok"] for v in flex.values())
    assert all("sdpa_forward_rel_err" in v for k, v in flex.items() if k.startswith("bigbird"))
    assert {r["case"] for r in results["attention"]} == {"sdpa causal", "sdpa window"}  # flex: CUDA only
    rows = {r["variant"]: r for r in results["gpt2_medium"]}
    assert list(rows) == [
        "sdpa, eager",
        "sdpa, compile_blocks",
        "flex, compile_blocks",
        "sdpa, compiled encode",
    ]
    assert "no backward pass on CPU" in rows["flex, compile_blocks"]["error"]  # refused, named
    eager = rows["sdpa, eager"]["first_loss"]
    assert abs(eager - math.log(1000)) < 0.05  # vocab 1,000 at initialisation
    for name in ("sdpa, compile_blocks", "sdpa, compiled encode"):
        assert rows[name]["first_loss"] == pytest.approx(eager, abs=1e-3), name
        assert rows[name]["ms"] > 0 and rows[name]["compile_s"] >= 0
    assert [r["model"] for r in results["train_step"]] == ["debug", "debug causal rope"]
