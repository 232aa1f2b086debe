"""A quiet, honest start: ``mmformer train`` prints the recipe as its difference from the defaults (the
whole one is the run folder's ``recipe.yaml``), ``run.json`` records the mmformer that ran (version and
its own git commit), ``train --help`` explains itself with examples, and train and validate draw the
same progress bar (``mmformer.build.trainer.progress_bars``)."""

from __future__ import annotations

import json
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest

import mmformer
from mmformer.build.trainer import progress_bars
from mmformer.cli import main
from mmformer.recipe import load_recipe, recipe_from_yaml, recipe_to_yaml
from mmformer.recipe.defaults import non_defaults, non_defaults_yaml
from mmformer.recipe.sections import TrainerConfig

RECIPES = sorted((Path(__file__).parents[1] / "recipes").rglob("*.yaml"))
HEADER = "# recipe, what differs from the defaults"


def test_non_defaults_of_the_tiny_recipe(tiny_recipe):
    recipe = load_recipe(tiny_recipe, ["optim.betas=[0.9,0.95]"])
    diff = non_defaults(recipe)
    assert diff["optim"] == {"lr": 3e-3, "betas": [0.9, 0.95], "warmup_steps": 2}  # weight_decay is default
    assert diff["trainer"] == {
        "max_epochs": 2,
        "accelerator": "cpu",
        "devices": 1,
        "log_every_n_steps": 1,
        "enable_progress_bar": False,
        "num_sanity_val_steps": 0,
    }
    assert diff["logger"] == {"mode": "disabled"}
    assert "checkpoint" not in diff and "multitask" not in diff and "resume" not in diff
    # the parts have no defaults: each is shown with its kind, less the values equal to its kind's defaults
    assert diff["model"]["heads"] == {"cls": {"kind": "classifier", "num_classes": 2}}
    assert diff["tasks"]["toy"]["data"]["batch_size"] == 4 and "shuffle" not in diff["tasks"]["toy"]["data"]
    assert "betas: [0.9, 0.95]" in non_defaults_yaml(recipe)  # lists of numbers on one line


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_the_printed_difference_loads_back_to_the_same_recipe(path):
    """Honest: defaults ← the printed lines is the recipe that runs, and it is much shorter than it."""
    recipe = load_recipe(path)
    printed = non_defaults_yaml(recipe)
    assert recipe_from_yaml(printed) == recipe
    assert len(printed.splitlines()) < len(recipe_to_yaml(recipe).splitlines()) // 2


def test_train_prints_the_difference_and_records_the_mmformer_that_ran(tiny_recipe, workdir, capsys):
    overrides = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "optim.lr=2e-3"]
    assert main(["train", str(tiny_recipe), *overrides]) == 0
    out = capsys.readouterr().out
    (run,) = [p for p in (workdir / "runs" / "tiny").iterdir() if p.is_dir()]
    recipe = load_recipe(tiny_recipe, overrides)

    # The start: the header names the whole recipe's file, then only the differing keys.
    assert f"{HEADER} (the whole recipe: {run / 'recipe.yaml'})\n" + non_defaults_yaml(recipe) in out
    start = out.split(HEADER, 1)[1].split("parameters:", 1)[0]
    assert "lr: 0.002" in start and "max_epochs: 1" in start
    keys = {line.strip().split(":")[0] for line in start.splitlines()[1:] if ":" in line}
    assert {"lr", "warmup_steps", "max_epochs", "kind", "image_size", "batch_size"} <= keys
    assert not keys & {"weight_decay", "eps", "schedule", "save_top_k", "precision", "monitor", "shuffle"}

    # The run folder holds the whole recipe, defaults included: over three times as long.
    whole = (run / "recipe.yaml").read_text()
    assert len(start.splitlines()) < len(whole.splitlines()) // 3
    assert whole == recipe_to_yaml(recipe) and "weight_decay: 0.05" in whole and "save_top_k:" in whole
    assert recipe_from_yaml(whole) == recipe

    # run.json: mmformer's version and the commit of the checkout it was imported from.
    info = json.loads((run / "run.json").read_text())
    package = Path(mmformer.__file__).parent
    head = subprocess.run(["git", "-C", str(package), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert head.returncode == 0, "these tests run from a git checkout of mmformer"
    assert info["mmformer_version"] == version("mmformer")
    assert info["mmformer_commit"] == head.stdout.strip() and len(info["mmformer_commit"]) == 40
    assert isinstance(info["mmformer_dirty"], bool)


def test_train_help_describes_and_gives_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "what differs from the defaults" in out and "recipe.yaml" in out
    assert "examples:\n  mmformer train recipes/image/vit_tiny_classify_mnist5k.yaml\n" in out
    assert "resume=auto" in out and "MMFORMER_PROGRESS" in out
    for line in out.splitlines():  # the examples name recipes that exist
        if line.startswith("  mmformer train recipes/"):
            assert (Path(__file__).parents[1] / line.split()[2]).is_file(), line


def test_train_and_validate_share_one_progress_bar(monkeypatch, capsys):
    monkeypatch.delenv("MMFORMER_PROGRESS", raising=False)
    (bar,) = progress_bars(TrainerConfig())
    assert bar.refresh_rate == 20  # captured stderr is no terminal: a line every 20 steps
    assert progress_bars(TrainerConfig(enable_progress_bar=False)) == []
    monkeypatch.setenv("MMFORMER_PROGRESS", "0")
    assert progress_bars(TrainerConfig()) == []
    monkeypatch.setenv("MMFORMER_PROGRESS", "1")
    assert progress_bars(TrainerConfig())[0].refresh_rate == 1


def test_validate_draws_the_training_bar(tiny_recipe, workdir, capsys, monkeypatch):
    """``MMFORMER_PROGRESS=0`` leaves training without any bar (Lightning adds none of its own); forced
    on, ``validate`` draws the bar training uses (Lightning's bars write to stdout)."""
    monkeypatch.setenv("MMFORMER_PROGRESS", "0")
    args = ["trainer.max_epochs=1", "trainer.enable_progress_bar=true", "trainer.limit_train_batches=2"]
    assert main(["train", str(tiny_recipe), *args]) == 0
    quiet = capsys.readouterr()
    assert "Epoch 0" not in quiet.out + quiet.err and "val/toy/acc" in quiet.out
    (ckpt,) = workdir.glob("runs/tiny/*/checkpoints/last.ckpt")

    import mmformer.commands.validate as validate

    built = []
    monkeypatch.setattr(validate, "progress_bars", lambda t: built.append(progress_bars(t)) or built[-1])
    monkeypatch.setenv("MMFORMER_PROGRESS", "1")
    assert main(["validate", str(ckpt), "trainer.enable_progress_bar=true"]) == 0
    captured = capsys.readouterr()
    assert len(built) == 1 and built[0][0].refresh_rate == 1
    assert "Validation DataLoader 0: 100%" in captured.out + captured.err  # Lightning's bars: stdout
    final = {
        line.split()[0]: float(line.split()[1]) for line in captured.out.splitlines() if line[:4] == "val/"
    }
    assert set(final) >= {"val/toy/acc", "val/toy/loss"} and 0.0 <= final["val/toy/acc"] <= 1.0
