"""Shared fixtures: a tiny real-format image folder and a tiny recipe, built per test (no prepared data)."""

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
