"""Shared fixtures: a tiny real-format image folder and a tiny recipe, built per test (no prepared data);
the tiny Llama and ViT shapes the model tests share, and a timm ViT checkpoint directory.

Tiers: ``@pytest.mark.slow`` marks tests that load real pretrained weights (SmolLM2, MiniLM, Whisper),
train the bundled recipes, launch several processes (DDP / FSDP2 through the CLI, ``mp.spawn``),
``torch.compile`` or otherwise take many seconds; ``make test`` runs the rest (``-m "not slow"``),
``make test-all`` everything."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")


def make_image_folder(root: Path, n_per_class: int = 8, classes=("bright", "dark"), size: int = 28) -> Path:
    """``root/{train,val}/<class>/*.png``: 'bright' images are light with noise, 'dark' ones dark."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", n_per_class), ("val", max(2, n_per_class // 2))):
        for ci, cls in enumerate(classes):
            d = root / split / cls
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                base = 200 if ci == 0 else 40
                px = np.clip(base + rng.normal(0, 25, (size, size)), 0, 255).astype(np.uint8)
                Image.fromarray(px, mode="L").save(d / f"{i:03d}.png")
    return root


# A tiny Llama (GQA, tied embeddings) in ``build_llama`` / ``transformers.LlamaConfig`` keys: 2 layers,
# d_model 32, 4 query and 2 key-value heads; tests change single keys with ``{**TINY_LLAMA, ...}``.
TINY_LLAMA = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10_000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)

# A tiny ViT in timm's ``VisionTransformer`` arguments: 32×32 images, 8×8 patches (a 4×4 grid), width
# 48, 2 blocks of 3 heads.
TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3)


def save_timm_dir(ref, out: Path, model_args: dict) -> Path:
    """``out/`` as timm's own HF exporter writes a checkpoint directory: ``model.safetensors`` and
    ``config.json`` (``model_args``: the arguments ``ref`` was created with)."""
    from safetensors.torch import save_file
    from timm.models._hub import save_config_for_hf

    out.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(out / "model.safetensors"))
    save_config_for_hf(ref, str(out / "config.json"), model_args=model_args)
    return out


TINY_RECIPE = """\
name: {name}
seed: 0
model:
  tokenizers: {{image: {{kind: vit_patch, image_size: 28, patch_size: 7, in_chans: 1, mean: [0.5], std: [0.25]}}}}
  backbone: {{preset: debug}}
  heads: {{cls: {{kind: classifier, num_classes: 2}}}}
tasks:
  toy:
    kind: classification
    tokenizer: image
    head: cls
    data: {{kind: image_folder, root: {root}, batch_size: 4, num_workers: 0}}
optim: {{lr: 3e-3, warmup_steps: 2}}
trainer: {{max_epochs: 2, accelerator: cpu, devices: 1, log_every_n_steps: 1, enable_progress_bar: false,
          num_sanity_val_steps: 0}}
logger: {{mode: disabled}}
"""


@pytest.fixture(autouse=True)
def _own_wandb_service():
    """A W&B run in the test process leaves its service's address in ``WANDB_SERVICE``, and a training
    process a later test starts would join that service instead of starting its own — where the id of a
    run killed with SIGKILL stays taken, so its resume fails ("run ID … is in use"). Each process the
    tests start runs its own service, as a user's does; this process's open connection is unaffected."""
    os.environ.pop("WANDB_SERVICE", None)


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """Runs and data roots inside the test's temporary folder."""
    monkeypatch.setenv("MMFORMER_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("MMFORMER_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("MMFORMER_RUN_ID", raising=False)
    monkeypatch.delenv("MMFORMER_RESUME_PATH", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return tmp_path


@pytest.fixture
def tiny_recipe(workdir) -> Path:
    folder = make_image_folder(workdir / "images")
    path = workdir / "tiny.yaml"
    path.write_text(TINY_RECIPE.format(name="tiny", root=folder))
    return path


@pytest.fixture
def timm_source(workdir) -> Path:
    """A timm ``vit_tiny_patch16_224`` of ``TINY_VIT``'s sizes with 5 classes (seed 0, timm's own
    initialisation), as a checkpoint directory ``workdir/timm_vit``."""
    timm = pytest.importorskip("timm")
    import torch

    torch.manual_seed(0)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, **TINY_VIT).eval()
    return save_timm_dir(ref, workdir / "timm_vit", TINY_VIT)
