"""One optimizer step of the same global batch, laid out five ways through the CLI — one process, 2-process
DDP, 2-process FSDP2, gradient accumulation on one process, DDP with accumulation — gives the same
gradient, read back from AdamW's first moment in ``last.ckpt`` (after one step ``exp_avg = (1 - β1) · g``).
For a language model with padded documents of different lengths this holds only because losses are
weighted by their target tokens over the whole window and all ranks (``data.windows``); a plain mean
of micro-batch means would differ. Also: FSDP2 with activation checkpointing and ``torch.compile``
trains, resumes and validates like the plain run, and its checkpoint keys are clean."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_RECIPE, make_image_folder

LM = """\
name: {name}
seed: 0
model:
  tokenizers: {{text: {{kind: bpe, vocab_size: 300, max_len: 48}}}}
  backbone: {{preset: debug, causal: true, positions: rope}}
  heads: {{lm: {{kind: lm}}}}
tasks:
  corpus:
    kind: causal_lm
    tokenizer: text
    head: lm
    data: {{kind: text, root: {corpus}, seq_len: 48, pack: false, batch_size: 8, val_fraction: 0.2}}
optim: {{lr: 1e-3, warmup_steps: 0}}
trainer: {{max_steps: 1, accelerator: cpu, devices: 1, enable_progress_bar: false, num_sanity_val_steps: 0,
          gradient_clip_val: null}}
logger: {{mode: disabled}}
"""

LAYOUTS = {  # name: (overrides, per-rank batch size)
    "ddp": (["trainer.devices=2", "trainer.strategy=ddp"], 4),
    "fsdp2": (["trainer.devices=2", "trainer.strategy=fsdp2"], 4),
    "accumulate": (["trainer.accumulate_grad_batches=4"], 2),
    "ddp_accumulate": (["trainer.devices=2", "trainer.strategy=ddp", "trainer.accumulate_grad_batches=2"], 2),
}


def _corpus(root: Path) -> Path:
    """Documents of very different lengths, so micro-batches hold very different token counts."""
    words = "the a light dark land sea river stone fire rain wind king city field house door".split()
    docs = []
    for i in range(40):
        n = 2 + (i * 7) % 29
        docs.append(" ".join(words[(i * 3 + j * 5) % len(words)] for j in range(n)) + ".")
    root.write_text("\n\n".join(docs) + "\n")
    return root


def _run(recipe: Path, workdir: Path, name: str, overrides: list[str]) -> Path:
    env = dict(os.environ, MMFORMER_RUNS=str(workdir / "runs" / name), PYTHONUNBUFFERED="1")
    res = subprocess.run(
        [sys.executable, "-m", "mmformer.cli", "train", str(recipe), *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return next((workdir / "runs" / name).glob("*/*/checkpoints/last.ckpt"))


def _gradients(ckpt: Path) -> tuple[list[torch.Tensor], dict]:
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    opt = state["optimizer_states"][0]
    beta1 = opt["param_groups"][0]["betas"][0]
    order = [pid for group in opt["param_groups"] for pid in group["params"]]
    return [opt["state"][pid]["exp_avg"] / (1 - beta1) for pid in order], state["state_dict"]


def _assert_same(reference: list[torch.Tensor], other: list[torch.Tensor], what: str) -> None:
    assert len(reference) == len(other), what
    for i, (a, b) in enumerate(zip(reference, other)):
        assert a.shape == b.shape, f"{what}: parameter {i}"
        scale = a.abs().max().clamp_min(1e-12)
        assert (a - b).abs().max() / scale < 2e-4, f"{what}: parameter {i} differs"


def _check_layouts(workdir: Path, recipe_text: str, batch_key: str) -> None:
    one = workdir / "one.yaml"
    one.write_text(recipe_text)
    reference, ref_state = _gradients(_run(one, workdir, "one", []))
    for name, (overrides, batch) in LAYOUTS.items():
        grads, state = _gradients(_run(one, workdir, name, [*overrides, f"{batch_key}={batch}"]))
        _assert_same(reference, grads, name)
        assert list(state) == list(ref_state), f"{name}: checkpoint keys differ"


@pytest.mark.slow
def test_layouts_give_the_same_language_model_gradient(workdir):
    corpus = _corpus(workdir / "corpus.txt")
    _check_layouts(workdir, LM.format(name="lm", corpus=corpus), "tasks.corpus.data.batch_size")


@pytest.mark.slow
def test_layouts_give_the_same_classifier_gradient(workdir):
    images = make_image_folder(workdir / "images", n_per_class=8)
    recipe = TINY_RECIPE.format(name="cls", root=images).replace("batch_size: 4", "batch_size: 8")
    recipe = recipe.replace("max_epochs: 2,", "max_steps: 1, gradient_clip_val: null,")
    _check_layouts(workdir, recipe, "tasks.toy.data.batch_size")


def test_plain_means_of_micro_batches_would_differ():
    """The check above can fail: on padded texts of different lengths, the mean of four micro-batch
    means has a gradient that differs from the token-weighted mean's by far more than its tolerance."""
    import torch.nn.functional as F

    from mmformer.tasks.language_model import IGNORE

    model = _tiny_lm()
    lengths = [3, 30, 5, 12, 40, 4, 22, 9]
    ids = torch.randint(0, 50, (8, 41), generator=torch.Generator().manual_seed(0))
    targets = ids[:, 1:].clone()
    for row, n in enumerate(lengths):
        targets[row, n:] = IGNORE

    def grad(loss_of):
        model.zero_grad()
        loss_of().backward()
        return [p.grad.clone() for p in model.parameters()]

    def ce(rows):
        logits = model(ids[rows], "text", "lm")[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten(), ignore_index=IGNORE)

    weighted = grad(lambda: ce(slice(0, 8)))
    means = grad(lambda: sum(ce(slice(i, i + 2)) for i in range(0, 8, 2)) / 4)
    with pytest.raises(AssertionError):
        _assert_same(weighted, means, "mean of means")


def _tiny_lm():
    from mmformer.models import AttentionConfig, PositionConfig, build_backbone
    from mmformer.models.heads import LMHead
    from mmformer.models.model import MultimodalModel
    from mmformer.tokenizers import TextEmbedding

    torch.manual_seed(0)
    return MultimodalModel(
        {"text": TextEmbedding(50, 32)},
        build_backbone(32, 2, AttentionConfig(4), positions=PositionConfig("rope"), causal=True),
        {"lm": LMHead(32, 50)},
    )


@pytest.mark.slow
def test_fsdp2_with_checkpointing_and_compile_trains_resumes_and_validates(workdir):
    images = make_image_folder(workdir / "images", n_per_class=8)
    recipe = workdir / "tiny.yaml"
    recipe.write_text(TINY_RECIPE.format(name="tiny", root=images))
    common = [
        "trainer.devices=2",
        "trainer.strategy=fsdp2",
        "trainer.activation_checkpointing=true",
        "trainer.compile=true",
    ]
    ckpt = _run(recipe, workdir, "fsdp", [*common, "trainer.max_epochs=1"])
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert not [k for k in state["state_dict"] if "_orig_mod" in k or "_checkpoint_wrapped" in k]
    _run(recipe, workdir, "fsdp", [*common, "trainer.max_epochs=2", "resume=auto"])
    resumed = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 2 * state["global_step"]
    env = dict(os.environ, MMFORMER_RUNS=str(workdir / "runs" / "fsdp"))
    res = subprocess.run(
        [sys.executable, "-m", "mmformer.cli", "validate", str(ckpt), "trainer.devices=1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "val/toy/acc" in res.stdout


@pytest.mark.parametrize(
    "flag", ["activation_checkpointing", pytest.param("compile", marks=pytest.mark.slow)]
)
def test_checkpointing_and_compile_leave_the_gradient_unchanged(flag):
    from mmformer.models import parallelize

    model = _tiny_lm
    ids = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(1))
    plain, changed = model(), model()
    n = (parallelize.checkpoint_blocks if flag == "activation_checkpointing" else parallelize.compile_blocks)(
        changed
    )
    assert n == 2
    assert list(changed.state_dict()) == list(plain.state_dict())
    grads = []
    for m in (plain, changed):
        m(ids, "text", "lm").float().square().mean().backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_sharded_checkpoints_resume_validate_and_merge_into_safetensors(workdir):
    from safetensors.torch import load_file

    images = make_image_folder(workdir / "images", n_per_class=8)
    recipe = workdir / "tiny.yaml"
    recipe.write_text(TINY_RECIPE.format(name="tiny", root=images))
    fsdp = ["trainer.devices=2", "trainer.strategy=fsdp2"]
    full = _run(recipe, workdir, "full", [*fsdp, "trainer.max_epochs=2"])

    sharded = [*fsdp, "checkpoint.sharded=true"]
    env = dict(os.environ, MMFORMER_RUNS=str(workdir / "runs" / "sharded"))

    def cli(*args):
        res = subprocess.run(
            [sys.executable, "-m", "mmformer.cli", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-4000:]
        return res.stdout

    cli("train", str(recipe), *sharded, "trainer.max_epochs=1")
    (last,) = (workdir / "runs" / "sharded").glob("*/*/checkpoints/last.ckpt")
    assert last.is_dir() and (last / ".metadata").is_file() and len(list(last.glob("*.distcp"))) == 2
    assert not list(last.parent.glob(".*.tmp")) and not list(last.parent.glob(".*.old"))
    cli("train", str(recipe), *sharded, "trainer.max_epochs=2", "resume=auto")  # resumes from the folder

    out = workdir / "merged.safetensors"
    cli("export", str(last), str(out), "--format", "safetensors")
    merged = load_file(str(out))
    reference = torch.load(full, map_location="cpu", weights_only=True)["state_dict"]
    assert set(merged) == set(reference)
    for k, v in reference.items():  # sharded + resumed == assembled + uninterrupted
        torch.testing.assert_close(merged[k], v, atol=1e-6, rtol=0, msg=k)
    one = ["trainer.devices=1", "trainer.strategy=auto", "checkpoint.sharded=false"]
    assert "val/toy/acc" in cli("validate", str(last), *one)


@pytest.mark.slow
def test_onednn_linears_give_the_same_gradient_on_one_process_ddp_and_fsdp2(workdir):
    """At width 384 the blocks' linears are large enough to run on oneDNN (``nn.onednn.MIN_WEIGHTS``;
    ``trainer.onednn_linears=true``, forced: the default measures which library is faster here): one
    process, DDP and FSDP2 (whose forward reads the gathered weights) give the gradient of PyTorch's own linears."""
    corpus = _corpus(workdir / "corpus.txt")
    one = workdir / "wide.yaml"
    one.write_text(
        LM.format(name="wide", corpus=corpus).replace("preset: debug,", "preset: debug, d_model: 384,")
    )
    reference, _ = _gradients(_run(one, workdir, "aten", ["trainer.onednn_linears=false"]))
    for name, overrides in {
        "onednn": [],
        "ddp": [*LAYOUTS["ddp"][0], "tasks.corpus.data.batch_size=4"],
        "fsdp2": [*LAYOUTS["fsdp2"][0], "tasks.corpus.data.batch_size=4"],
    }.items():
        overrides = [*overrides, "trainer.onednn_linears=true"]
        _assert_same(reference, _gradients(_run(one, workdir, name, overrides))[0], name)
