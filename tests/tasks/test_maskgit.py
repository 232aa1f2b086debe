"""MaskGIT / Muse (``mmformer.models.maskgit``, ``mmformer.tasks.maskgit``): the cosine schedule, the
training mask, confidence-ordered parallel decoding that never re-masks, guidance on logits, the loss on
masked positions only, and the task end to end through the CLI on a tiny real codec checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

from mmformer.cli import main
from mmformer.models.maskgit import decode, decode_schedule, guided_logits, mask_ratio, training_mask
from mmformer.nn.tokens import Tokens
from mmformer.tasks.maskgit import MaskGITTask
from mmformer.tokenizers.codes import MaskedCodeTokenizer
from mmformer.tokenizers.vq import VQVAE
from tests.conftest import make_image_folder

# ---------------------------------------------------------------------------------------------- schedule


def test_mask_schedule_is_the_cosine_formula():
    r = torch.linspace(0, 1, 11)
    expected = torch.tensor([math.cos(math.pi * x / 2) for x in r.tolist()])
    assert torch.allclose(mask_ratio(r), expected, atol=1e-7)
    assert float(mask_ratio(0.0)) == 1.0 and abs(float(mask_ratio(1.0))) < 1e-7


def test_decode_schedule_follows_the_reference_and_decodes_at_least_one_per_step():
    # 49 codes in 8 rounds: floor(49 · cos(π/2 · t/8)) for t = 1..7, then 0 (maskgit parallel_decode)
    expected = [max(1, math.floor(49 * math.cos(math.pi / 2 * (t + 1) / 8))) for t in range(7)] + [0]
    assert decode_schedule(49, 8) == expected
    assert decode_schedule(6, 6) == [5, 4, 3, 2, 1, 0]  # T = N: exactly one token per round
    with pytest.raises(ValueError, match=r"steps=7 must be in \[1, 6\]"):
        decode_schedule(6, 7)


def test_training_mask_counts_follow_the_sampled_ratio():
    g = torch.Generator().manual_seed(0)
    mask = training_mask(4000, 49, generator=g)
    counts = mask.sum(1)
    assert counts.min() >= 1 and counts.max() <= 49
    # r ~ U(0, 1): E[⌈49 cos(π r / 2)⌉] = 49 · 2/π + ~0.5
    assert abs(counts.float().mean().item() - (49 * 2 / math.pi + 0.5)) < 0.6
    g = torch.Generator().manual_seed(1)
    r = torch.rand(3, generator=g)
    again = training_mask(3, 49, generator=torch.Generator().manual_seed(1))
    assert again.sum(1).tolist() == torch.ceil(mask_ratio(r) * 49).long().clamp(1, 49).tolist()


# ---------------------------------------------------------------------------------------------- decoding
K, MASK = 5, 5


def _fn(seed: int, n: int, record: list | None = None):
    """Logits that depend on the current ids (a tiny random 'network'), recorded per call."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, K + 1, n, K, generator=g)  # position i's logits from the one-hot of every id

    def fn(ids: torch.Tensor) -> torch.Tensor:
        onehot = torch.nn.functional.one_hot(ids, K + 1).float()  # (B, N, K+1)
        logits = torch.einsum("bjc,jcik->bik", onehot, w) * 2.0
        if record is not None:
            record.append((ids.clone(), logits.clone()))
        return logits

    return fn


def test_with_one_round_per_token_and_argmax_the_order_is_by_confidence():
    n, calls = 6, []
    ids = decode(_fn(0, n, calls), 3, n, MASK, steps=n, temperature=0, choice_temperature=0)
    assert (ids != MASK).all() and len(calls) == n
    for t, (before, logits) in enumerate(calls):
        after = calls[t + 1][0] if t + 1 < n else ids
        new = (before == MASK) & (after != MASK)
        assert new.sum(1).tolist() == [1, 1, 1]  # one token per round
        p = logits.softmax(-1).max(-1).values.masked_fill(before != MASK, -1)  # confidence of masked ones
        assert torch.equal(new.float().argmax(1), p.argmax(1))  # the most confident one was decoded
        assert torch.equal(after[new], logits.argmax(-1)[new])  # with its argmax token


def test_decoded_tokens_are_never_remasked_or_changed():
    n, seen = 16, []
    decode(
        _fn(1, n),
        4,
        n,
        MASK,
        steps=5,
        temperature=1.0,
        choice_temperature=4.5,
        generator=torch.Generator().manual_seed(0),
        callback=lambda t, ids: seen.append(ids.clone()),
    )
    left = [int((s == MASK).sum(1)[0]) for s in seen]
    assert left == decode_schedule(n, 5) and all(
        int((s == MASK).sum(1).max()) == m for s, m in zip(seen, left)
    )
    for prev, cur in zip(seen, seen[1:]):
        known = prev != MASK
        assert torch.equal(cur[known], prev[known])


def test_guidance_scale_one_is_the_conditional_logits_and_zero_the_unconditional():
    c, u = torch.randn(2, 7, 9), torch.randn(2, 7, 9)
    assert torch.equal(guided_logits(c, u, 1.0), c)
    assert torch.allclose(guided_logits(c, u, 0.0), u, atol=1e-6)
    assert torch.allclose(guided_logits(c, u, 3.0), u + 3 * (c - u))


# ---------------------------------------------------------------------------------------------- the task
def _tiny(num_classes=3, text=False):
    from mmformer.models.backbone import build_backbone
    from mmformer.models.backbone_config import AttentionConfig
    from mmformer.models.heads import MLMHead, ProjectorHead
    from mmformer.models.model import MultimodalModel
    from mmformer.tokenizers.text import TextEmbedding

    torch.manual_seed(0)
    codec = VQVAE(image_size=8, in_chans=1, channels=(8,), d_latent=8, codebook_size=6, code_dim=4).eval()
    tok = MaskedCodeTokenizer(16, codec, num_classes, 0.1, text)
    head = MLMHead(16, 7)
    head.tie_to(tok.tok_embed)
    tokenizers, heads = {"image": tok}, {"codes": head}
    if text:
        tokenizers["caption"] = TextEmbedding(20, 16)
        heads["proj"] = ProjectorHead(16, 16)
    model = MultimodalModel(tokenizers, build_backbone(16, 2, AttentionConfig(2)), heads).eval()
    task = MaskGITTask(
        "image", "codes", "caption" if text else None, "proj" if text else None, conditional=True
    )
    return model, task


def test_guided_logits_of_the_task_at_scale_one_equal_the_conditional_pass():
    model, task = _tiny()
    ids = torch.randint(0, 7, (2, 16))
    cond = task.condition(model, torch.tensor([0, 2]))
    with torch.no_grad():
        plain = task.logits(model, ids, cond)
        assert torch.allclose(task.guided(model, ids, cond, 1.0), plain, atol=1e-5)  # one batch of 2B
        dropped = task.logits(model, ids, cond, force_drop=torch.ones(2, dtype=torch.bool))
        assert torch.allclose(task.guided(model, ids, cond, 0.0), dropped, atol=1e-5)
        assert not torch.allclose(plain, dropped, atol=1e-4)  # the class changes the logits


def test_text_prefix_drop_leaves_only_the_null_token():
    model, task = _tiny(num_classes=None, text=True)
    ids, valid = (
        torch.randint(1, 20, (2, 5)),
        torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool),
    )
    with torch.no_grad():
        cond = task.condition(model, None, (ids, valid))
        tok = model.tokenizers["image"]
        out = tok.text_prefix(cond["prefix"], torch.tensor([True, False]))
        assert out.valid.tolist() == [[True, False, False, False, False], valid[1].tolist()]
        assert torch.equal(out.x[0, 0], tok.null_text) and torch.equal(out.x[1], cond["prefix"].x[1])
        codes = torch.randint(0, 6, (2, 16))
        g = task.guided(model, codes, cond, 1.0)
        assert torch.allclose(g, task.logits(model, codes, cond), atol=1e-5)
        assert g.shape == (2, 16, 6)  # never the [MASK] id


def test_loss_only_on_masked_positions():
    model, task = _tiny()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (3, 16), generator=g)
    mask = training_mask(3, 16, generator=g)
    cond = task.condition(model, torch.tensor([0, 1, 2]))
    loss = task.masked_loss(model, ids, mask, cond)
    # the loss is the cross-entropy of the masked positions alone (inputs: [MASK] there, the ids elsewhere)
    mask_id = model.tokenizers["image"].mask_id
    logits = task.logits(model, ids.masked_fill(mask, mask_id), cond)
    expected = torch.nn.functional.cross_entropy(logits[mask], ids[mask], label_smoothing=0.1)
    assert torch.allclose(loss, expected, atol=1e-6)
    # the gradient reaches the logits of masked positions only
    logits = task.logits(model, ids.masked_fill(mask, mask_id), cond).detach().requires_grad_(True)
    torch.nn.functional.cross_entropy(logits[mask], ids[mask]).backward()
    assert (logits.grad.abs().sum(-1) > 0).eq(mask).all()


def test_sample_refuses_bad_steps_samplers_and_conditions():
    model, task = _tiny()
    with pytest.raises(ValueError, match=r"steps=17 must be in \[1, 16\]"):
        task.sample(model, torch.tensor([0]), steps=17)
    with pytest.raises(ValueError, match="does not fit MaskGIT"):
        task.sample(model, torch.tensor([0]), sampler="euler")
    with pytest.raises(ValueError, match="class-conditional: give class labels"):
        task.sample(model, None, n=2)
    images = task.sample(
        model, torch.tensor([0, 1]), cfg_scale=2.0, steps=4, generator=torch.Generator().manual_seed(0)
    )
    assert images.shape == (2, 1, 8, 8) and images.min() >= -1 and images.max() <= 1


def test_code_tokenizer_refuses_bad_ids():
    model, _ = _tiny()
    tok = model.tokenizers["image"]
    with pytest.raises(ValueError, match=r"expected code ids \(B, 16\)"):
        tok(torch.zeros(1, 15, dtype=torch.long))
    with pytest.raises(ValueError, match=r"code ids must be in \[0, 6\]"):
        tok(torch.full((1, 16), 7))
    assert isinstance(tok(torch.zeros(1, 16, dtype=torch.long), torch.tensor([1])), Tokens)


# ---------------------------------------------------------------------------------------------- CLI
VQ_RECIPE = """\
name: tinyvq
model:
  tokenizers:
    image: {{kind: vq, image_size: 28, in_chans: 1, channels: [8, 8], d_latent: 8, codebook_size: 16,
            code_dim: 4}}
  backbone: {{d_model: 8, n_layers: 1, n_heads: 1}}
tasks:
  digits: {{kind: vq, tokenizer: image, data: {{kind: image_folder, root: {root}, batch_size: 4, num_workers: 0}}}}
optim: {{lr: 1e-3, warmup_steps: 1}}
trainer: {{max_steps: 2, accelerator: cpu, devices: 1, enable_progress_bar: false, num_sanity_val_steps: 0}}
logger: {{mode: disabled}}
"""

RECIPE = """\
name: tinymaskgit
model:
  tokenizers:
    image: {{kind: vq_codes, checkpoint: {vq}, image_size: 28, in_chans: 1, codebook_size: {K}, num_classes: 2}}
  backbone: {{d_model: 32, n_layers: 2, n_heads: 2}}
  heads: {{codes: {{kind: codes}}}}
tasks:
  toy:
    kind: maskgit
    tokenizer: image
    head: codes
    sample_steps: 3
    samples_per_class: 3
    data: {{kind: image_folder, root: {root}, batch_size: 4, num_workers: 0}}
optim: {{lr: 1e-3, warmup_steps: 1}}
trainer: {{max_steps: 3, accelerator: cpu, devices: 1, log_every_n_steps: 1, enable_progress_bar: false,
          num_sanity_val_steps: 0}}
logger: {{mode: disabled}}
"""


@pytest.mark.slow
def test_trains_on_a_real_codec_writes_grids_and_samples_from_the_cli(workdir, capsys):
    root = make_image_folder(workdir / "imgs", n_per_class=4)
    (workdir / "vq.yaml").write_text(VQ_RECIPE.format(root=root))
    assert main(["train", str(workdir / "vq.yaml")]) == 0
    vq = next((workdir / "runs" / "tinyvq").glob("*/checkpoints/last.ckpt"))
    # a codec of another codebook size than the recipe asks is refused, both sizes named
    (workdir / "bad.yaml").write_text(RECIPE.format(vq=vq, root=root, K=32))
    assert main(["train", str(workdir / "bad.yaml")]) == 2
    assert "codebook_size=16 (asked: 32)" in capsys.readouterr().err
    (workdir / "mg.yaml").write_text(RECIPE.format(vq=vq, root=root, K=16))
    # AFT's position biases must cover the class token + the codec's 7×7 codes: refused before any step
    aft = ["model.backbone.attn_kernel=aft_full", "model.backbone.kernel_options={max_len: 49}"]
    assert main(["train", str(workdir / "mg.yaml"), *aft]) == 2
    assert "gives 50 tokens per sequence" in capsys.readouterr().err
    assert main(["train", str(workdir / "mg.yaml")]) == 0
    out = capsys.readouterr().out
    assert "val/toy/loss_uncond" in out and "val/toy/acc" in out
    run = next((workdir / "runs" / "tinymaskgit").glob("*"))
    grid = sorted((run / "samples").glob("toy-step*.png"))[-1]
    assert Image.open(grid).size == (3 * 29 + 1, 2 * 29 + 1)  # 3 per class, 2 classes
    ckpt = str(run / "checkpoints" / "last.ckpt")
    png = workdir / "grid.png"
    args = ["sample", ckpt, "--class", "1", "--n", "4", "--cfg-scale", "2", "--steps", "4", "--out", str(png)]
    assert main(args) == 0
    assert Image.open(png).size == (4 * 29 + 1, 29 + 1)
    assert main(["sample", ckpt, "--steps", "50", "--out", str(png)]) == 2
    assert "steps=50 must be in [1, 49]" in capsys.readouterr().err
    assert main(["sample", ckpt, "--sampler", "ddim", "--out", str(png)]) == 2
    assert "does not fit MaskGIT" in capsys.readouterr().err
    assert main(["sample", str(vq), "--out", str(png)]) == 2  # a codec alone does not sample
    err = capsys.readouterr().err
    assert (
        "has no task that samples images (its tasks are vq)" in err and "maskgit" in err.split("sample:")[1]
    )
