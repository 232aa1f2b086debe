"""Every ``lightning.Trainer`` argument under ``trainer`` (``mmformer.recipe.trainer_args``): checked against
Lightning's signature with a did-you-mean, refused with a reason where mmformer sets it, passed through to
the run (fast_dev_run, overfit_batches, detect_anomaly, profiler) through the CLI on the tiny recipe."""

from __future__ import annotations

import csv

import lightning as L
import pytest
import torch

from mmformer.cli import main
from mmformer.commands.train import train
from mmformer.recipe import load_recipe, recipe_from_yaml, recipe_to_yaml
from mmformer.recipe.trainer_args import describe, fits, lightning_arguments, trainer_keys
from mmformer.training.checkpoint_io import read_checkpoint_file


def _run_dir(workdir):
    (run,) = [p for p in (workdir / "runs" / "tiny").iterdir() if p.is_dir()]
    return run


def test_lightning_arguments_load_into_extra_and_write_back_under_trainer(tiny_recipe):
    overrides = ["trainer.fast_dev_run=3", "trainer.profiler=simple", "trainer.benchmark=false"]
    recipe = load_recipe(tiny_recipe, [*overrides, "trainer.deterministic=warn"])
    assert recipe.trainer.extra == {"fast_dev_run": 3, "profiler": "simple", "benchmark": False}
    assert recipe.trainer.deterministic == "warn"
    text = recipe_to_yaml(recipe)
    trainer_lines = text.split("\ntrainer:\n")[1].split("\nlogger:")[0].splitlines()
    assert "  fast_dev_run: 3" in trainer_lines and "  profiler: simple" in trainer_lines
    assert "extra" not in text
    assert recipe_from_yaml(text) == recipe  # the written recipe reloads to the same one


def test_lightning_arguments_in_the_recipe_file(tiny_recipe):
    text = tiny_recipe.read_text().replace(
        "num_sanity_val_steps: 0", "num_sanity_val_steps: 0, min_epochs: 1"
    )
    tiny_recipe.write_text(text)
    assert load_recipe(tiny_recipe).trainer.extra == {"min_epochs": 1}


def test_typo_names_the_key_and_suggests(tiny_recipe, capsys):
    assert main(["train", str(tiny_recipe), "trainer.fast_dev_runn=true"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe key 'trainer.fast_dev_runn'. Did you mean 'trainer.fast_dev_run'?" in err
    assert "detect_anomaly" in err and "validate_first" in err  # the valid keys: Lightning's and mmformer's


def test_typo_in_the_recipe_file_suggests_too(tiny_recipe, capsys):
    tiny_recipe.write_text(tiny_recipe.read_text().replace("num_sanity_val_steps: 0", "overfit_batchs: 2"))
    assert main(["info", str(tiny_recipe)]) == 2
    assert "'trainer.overfit_batchs'. Did you mean 'trainer.overfit_batches'?" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "trainer.callbacks=[]",
            "'trainer.callbacks' cannot be set in a recipe: mmformer adds its own callbacks",
        ),
        (
            "trainer.default_root_dir=/tmp",
            "'trainer.default_root_dir' cannot be set in a recipe: the run folder",
        ),
        ("trainer.fast_dev_run=abc", "fast_dev_run expects int | bool, got 'abc' (str)"),
        (
            "trainer.profiler=simpel",
            "profiler='simpel'; choose simple | advanced | pytorch | xla. Did you mean 'simple'?",
        ),
        ("trainer.extra.max_steps=3", "max_steps is a typed trainer key: set trainer.max_steps"),
        (
            "trainer.extra.fast_dev_runn=1",
            "fast_dev_runn is not an argument of lightning.Trainer. Did you mean",
        ),
        ("trainer.deterministic=maybe", "deterministic='maybe'; choose true | false | warn"),
    ],
)
def test_refused_trainer_arguments_say_why(tiny_recipe, capsys, override, expected):
    assert main(["info", str(tiny_recipe), override]) == 2
    assert expected in capsys.readouterr().err


def test_every_lightning_argument_is_a_trainer_key_unless_mmformer_sets_it():
    keys = set(trainer_keys())
    assert {
        "fast_dev_run",
        "profiler",
        "overfit_batches",
        "detect_anomaly",
        "validate_first",
        "compile",
    } <= keys
    assert not keys & {
        "logger",
        "callbacks",
        "plugins",
        "default_root_dir",
        "use_distributed_sampler",
        "extra",
    }
    assert set(lightning_arguments()) - keys == {
        "logger",
        "callbacks",
        "plugins",
        "default_root_dir",
        "use_distributed_sampler",
        "enable_checkpointing",
        "inference_mode",
        "barebones",
    }


def test_values_are_checked_against_lightnings_annotations():
    hints = lightning_arguments()
    assert fits(True, hints["fast_dev_run"]) and fits(5, hints["fast_dev_run"])
    assert not fits("yes", hints["fast_dev_run"]) and not fits(0.5, hints["fast_dev_run"])
    assert fits(0.25, hints["overfit_batches"]) and fits(2, hints["overfit_batches"])
    assert fits("warn", hints["deterministic"]) and not fits("always", hints["deterministic"])
    assert describe(hints["min_epochs"]) == "int | null"


def test_fast_dev_run_is_a_smoke_test_that_writes_no_checkpoint(tiny_recipe, workdir, capsys):
    assert main(["train", str(tiny_recipe), "trainer.fast_dev_run=true", "logger.mode=offline"]) == 0
    out = capsys.readouterr().out
    assert "trainer.fast_dev_run: a smoke test of 1 training and 1 validation batch(es) per task" in out
    assert "(1 optimizer step(s)); no checkpoint, metrics.csv or W&B run was written" in out
    final = {line.split()[0]: float(line.split()[1]) for line in out.splitlines() if line.startswith("val/")}
    assert set(final) == {"val/toy/acc", "val/toy/balanced_acc", "val/toy/loss"}
    run = _run_dir(workdir)
    assert not list(run.rglob("*.ckpt"))  # no best, no last.ckpt: resume=auto finds nothing
    assert not (run / "metrics.csv").exists() and not (run / "wandb").exists()
    assert "fast_dev_run: true" in (run / "recipe.yaml").read_text()


def test_overfit_batches_and_detect_anomaly_reach_the_trainer(tiny_recipe, workdir, capsys, monkeypatch):
    modes = []
    real = torch.autograd.set_detect_anomaly

    def spy(mode, *args, **kwargs):
        modes.append(mode)
        return real(mode, *args, **kwargs)

    monkeypatch.setattr(torch.autograd, "set_detect_anomaly", spy)
    overrides = ["trainer.overfit_batches=1", "trainer.detect_anomaly=true", "trainer.max_epochs=2"]
    assert main(["train", str(tiny_recipe), *overrides]) == 0
    run = _run_dir(workdir)
    # 16 training images in batches of 4 make 4 steps an epoch; overfit_batches=1 trains 1 of them
    assert read_checkpoint_file(run / "checkpoints" / "last.ckpt")["global_step"] == 2
    with open(run / "metrics.csv") as f:
        steps = {int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")}
    assert steps == {0, 1}
    assert modes == [True]  # Lightning wraps fit in torch.autograd.set_detect_anomaly(True)


class TrainBatches(L.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(repr(batch))


def test_overfit_batches_trains_the_same_batches_every_epoch(tiny_recipe, workdir):
    """Lightning's meaning: the same few batches, epoch after epoch (mmformer's sampler reshuffles per
    epoch otherwise)."""
    batches = TrainBatches()
    recipe = load_recipe(tiny_recipe, ["trainer.overfit_batches=1", "trainer.max_epochs=3"])
    train(recipe, extra_callbacks=[batches])
    assert len(batches.seen) == 3 and len(set(batches.seen)) == 1


def test_profiler_simple_writes_its_report(tiny_recipe, workdir, capsys):
    overrides = ["trainer.profiler=simple", "trainer.limit_train_batches=1", "trainer.max_epochs=1"]
    assert main(["train", str(tiny_recipe), *overrides]) == 0
    run = _run_dir(workdir)
    report = run / "fit-profile.txt"
    assert f"profiler report: {report}" in capsys.readouterr().out
    text = report.read_text()
    assert "FIT Profiler Report" in text and "run_training_batch" in text
