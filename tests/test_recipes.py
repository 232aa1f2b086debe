"""Every bundled recipe validates and trains a few steps (litgpt's test_config_hub). Bundled datasets
are prepared on demand into the test's own data root, as `mmformer train` does for a new user."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from mmformer.cli import main
from mmformer.config import load_recipe
from mmformer.data.prepare import BUNDLED

RECIPES = sorted((Path(__file__).parents[1] / "recipes").rglob("*.yaml"))


def test_recipes_exist():
    assert RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_opens_with_launch_comment_and_name_matches(path):
    text = path.read_text()
    assert text.startswith("#") and "Launch:" in text.split("\n\n")[0]
    assert load_recipe(path).name == path.stem


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_trains_a_few_steps(path, workdir, capsys):
    recipe = load_recipe(path)
    for task in recipe.tasks.values():  # a bundled source this machine cannot provide → skip, saying why
        missing = BUNDLED[task.data.root].missing() if task.data.root in BUNDLED else None
        if missing:
            pytest.skip(missing)
    overrides = [
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=2",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_progress_bar=false",
        "logger.mode=disabled",
        "trainer.accelerator=cpu",
        "trainer.devices=1",
    ]
    overrides += [f"tasks.{name}.data.num_workers=0" for name in recipe.tasks]
    for name, task in recipe.tasks.items():  # the sample grid after validation: small and few steps
        if task.kind == "diffusion":
            overrides += [f"tasks.{name}.sample_steps=2", f"tasks.{name}.samples_per_class=1"]
    assert main(["train", str(path), *overrides]) == 0
    captured = capsys.readouterr()
    out = captured.out
    for task in recipe.tasks.values():  # a missing bundled dataset is prepared, saying so
        if task.data.root in BUNDLED:
            assert f"bundled dataset '{task.data.root}' is missing" in captured.err
    finals = [ln for ln in out.splitlines() if ln.startswith("val/")]
    assert finals, out[-2000:]
    for line in finals:
        assert math.isfinite(float(line.split()[1])), line
    run = Path(out.split("run folder: ")[1].split()[0])
    losses = [
        float(r["train/loss"]) for r in csv.DictReader(open(run / "metrics.csv")) if r.get("train/loss")
    ]
    assert len(losses) >= 1 and all(math.isfinite(v) for v in losses)
