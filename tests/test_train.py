"""End-to-end training through the CLI code path on a tiny fixture: run folder, W&B offline records,
checkpoints that load with weights_only=True, and resume == uninterrupted."""

from __future__ import annotations

import csv
import json
import os

import lightning as L
import pytest
import torch

from mmformer.cli import main
from mmformer.commands.train import train
from mmformer.recipe import load_recipe, recipe_from_yaml
from mmformer.training.runs import RESUME_ENV, RUN_ID_ENV, open_run
from tests.wandb_records import history_and_config


class StopAfterEpoch(L.Callback):
    """Simulates an interruption: stop once epoch ``epoch`` has finished (after its checkpoint)."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


def _run_dirs(workdir, name):
    return sorted(p for p in (workdir / "runs" / name).iterdir() if p.is_dir())


def test_train_offline_writes_run_folder_wandb_and_checkpoints(tiny_recipe, workdir, capsys):
    assert main(["train", str(tiny_recipe), "logger.mode=offline", "trainer.max_epochs=1"]) == 0
    out = capsys.readouterr().out
    assert "# recipe, what differs from the defaults" in out
    final = {line.split()[0]: float(line.split()[1]) for line in out.splitlines() if line.startswith("val/")}
    assert (
        set(final) == {"val/toy/acc", "val/toy/balanced_acc", "val/toy/loss"}
        and 0.0 <= final["val/toy/acc"] <= 1.0
    )

    (run,) = _run_dirs(workdir, "tiny")
    assert f"run folder: {run}" in out
    for name in ("recipe.yaml", "run.json", "metrics.csv", "checkpoints/last.ckpt"):
        assert (run / name).is_file(), name
    info = json.loads((run / "run.json").read_text())
    assert info["run_id"] == run.name and info["wandb_id"]

    # The checkpoint loads without unpickling code and carries the recipe as YAML text.
    ckpt = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    assert recipe_from_yaml(ckpt["mmformer"]["recipe_yaml"]) == load_recipe(
        tiny_recipe, ["logger.mode=offline", "trainer.max_epochs=1"]
    )
    assert (run / "recipe.yaml").read_text() == ckpt["mmformer"]["recipe_yaml"]

    # W&B offline: the run's own file holds the metrics and the recipe.
    (wandb_file,) = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    rows, config = history_and_config(wandb_file)
    keys = set().union(*rows)
    for key in (
        "train/loss",
        "train/toy/loss",
        "lr",
        "val/toy/acc",
        "val/toy/loss",
        "throughput/samples_per_sec",
        "trainer/global_step",
    ):
        assert key in keys, key
    assert config["name"] == "tiny" and config["optim"]["lr"] == pytest.approx(3e-3)
    val_rows = [r for r in rows if "val/toy/acc" in r]
    assert val_rows[-1]["val/toy/acc"] == pytest.approx(final["val/toy/acc"], abs=1e-4)

    # metrics.csv has the same final validation.
    csv_rows = list(csv.DictReader(open(run / "metrics.csv")))
    last_val = [r for r in csv_rows if r.get("val/toy/acc")][-1]
    assert float(last_val["val/toy/acc"]) == pytest.approx(final["val/toy/acc"], abs=1e-4)

    # an override that changes the trained parameters' shapes is named, not a raw size mismatch
    capsys.readouterr()
    assert main(["validate", str(run / "checkpoints/last.ckpt"), "model.backbone.mlp_ratio=1"]) == 2
    err = capsys.readouterr().err
    assert "its weights do not fit the model its recipe builds with these overrides (size mismatch for" in err


def test_resume_equals_uninterrupted_and_continues_the_run(tiny_recipe, workdir):
    # Uninterrupted: 2 epochs × 4 steps.
    full, _ = train(load_recipe(tiny_recipe, ["name=full"]))
    w_full = {k: v.clone() for k, v in full.lightning_module.state_dict().items()}

    # Interrupted after epoch 0 (N = 4 steps, an epoch boundary), then resume=auto for the rest.
    part, run1 = train(load_recipe(tiny_recipe, ["name=part", "logger.mode=offline"]), [StopAfterEpoch(0)])
    assert part.global_step == 4
    resumed, run2 = train(load_recipe(tiny_recipe, ["name=part", "logger.mode=offline", "resume=auto"]))
    assert resumed.global_step == 8
    w_resumed = resumed.lightning_module.state_dict()
    for k, v in w_full.items():
        torch.testing.assert_close(w_resumed[k], v, atol=1e-6, rtol=0, msg=k)

    # Same run folder, same W&B id, metrics.csv appended, logged step continues.
    assert run2.dir == run1.dir and _run_dirs(workdir, "part") == [run1.dir]
    info = json.loads((run1.dir / "run.json").read_text())
    assert info["wandb_id"] == run1.wandb_id == run2.wandb_id and len(info["resumes"]) == 1
    steps = [int(r["step"]) for r in csv.DictReader(open(run1.dir / "metrics.csv"))]
    assert min(steps) < 4 and max(steps) >= 7
    offline = sorted((run1.dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(run1.wandb_id in p.name for p in offline)
    first_rows, _ = history_and_config(next(offline[0].glob("*.wandb")))
    second_rows, _ = history_and_config(next(offline[1].glob("*.wandb")))
    first_max = max(r["trainer/global_step"] for r in first_rows if "trainer/global_step" in r)
    second = [
        r["trainer/global_step"] for r in second_rows if "trainer/global_step" in r and "train/loss" in r
    ]
    assert first_max <= 4 and min(second) >= 4 and max(second) >= 7


def test_recipe_typo_fails_before_training(tiny_recipe, capsys):
    assert main(["train", str(tiny_recipe), "optim.lrr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "optim.lrr" in err and "Did you mean 'optim.lr'?" in err


def test_flex_is_refused_for_training_on_the_cpu_before_data_is_read(tiny_recipe, workdir, capsys):
    """FlexAttention has no CPU backward: refused at once (the data root does not exist, and the error
    is still the kernel's)."""
    bad_root = f"tasks.toy.data.root={workdir}/missing"
    flex = "model.backbone.attn_kernel=flex"
    assert main(["train", str(tiny_recipe), flex, "trainer.accelerator=cpu", bad_root]) == 2
    err = capsys.readouterr().err
    assert "'model.backbone.attn_kernel': flex has no backward pass on the CPU" in err
    assert "trainer.accelerator=cpu" in err and "missing" not in err


def test_missing_user_data_path_is_named(tiny_recipe, workdir, capsys):
    assert main(["train", str(tiny_recipe), f"tasks.toy.data.root={workdir}/missing"]) == 2
    assert f"{workdir}/missing" in capsys.readouterr().err


def test_corrupt_images_are_counted_at_the_end(tiny_recipe, workdir, capsys):
    bad = workdir / "images" / "train" / "dark" / "001.png"
    bad.write_bytes(b"\x89PNG broken")
    assert main(["train", str(tiny_recipe), "trainer.max_epochs=1"]) == 0
    out = capsys.readouterr().out
    assert "data/bad_samples 1" in out


def test_validate_refuses_a_foreign_checkpoint(workdir, capsys):
    torch.save({"state_dict": {}}, workdir / "other.ckpt")
    assert main(["validate", str(workdir / "other.ckpt")]) == 2
    assert "not an mmformer training checkpoint" in capsys.readouterr().err


def test_prepare_unknown_dataset_suggests(workdir, capsys):
    assert main(["data", "prepare", "mnist5"]) == 2
    assert "Did you mean 'mnist5k'?" in capsys.readouterr().err


def test_class_count_mismatch_is_named(tiny_recipe, capsys):
    assert main(["train", str(tiny_recipe), "model.heads.cls.num_classes=3"]) == 2
    assert "has 2 class folders (bright, dark) but the head has num_classes=3" in capsys.readouterr().err


def test_resume_with_a_changed_recipe_says_so_and_keeps_the_original(tiny_recipe, workdir, capsys):
    assert main(["train", str(tiny_recipe), "trainer.max_epochs=1"]) == 0
    (run,) = _run_dirs(workdir, "tiny")
    capsys.readouterr()
    assert main(["train", str(tiny_recipe), "trainer.max_epochs=2", "resume=auto"]) == 0
    out = capsys.readouterr().out
    assert f"resuming run {run.name} from {run}/checkpoints/last.ckpt (epoch 0, global step 4)" in out
    assert "trainer.max_epochs: 1 → 2" in out
    assert "max_epochs: 1\n" in (run / "recipe.yaml").read_text()
    assert "max_epochs: 2\n" in (run / "recipe.resume-1.yaml").read_text()
    assert _run_dirs(workdir, "tiny") == [run]


def test_backbone_variants_train_from_the_recipe(tiny_recipe, capsys):
    overrides = [
        "trainer.max_steps=2",
        "model.backbone.positions=rope",
        "model.backbone.rope_axes=2",
        "model.backbone.norm=rmsnorm",
        "model.backbone.act=swiglu",
        "model.backbone.n_kv_heads=1",
        "model.backbone.qk_norm=true",
        "model.backbone.layer_scale=1e-5",
        "model.backbone.drop_path=0.1",
    ]
    assert main(["train", str(tiny_recipe), *overrides]) == 0
    assert "val/toy/acc" in capsys.readouterr().out
    assert main(["train", str(tiny_recipe), "model.backbone.positions=rop"]) == 2
    assert "Did you mean 'rope'?" in capsys.readouterr().err


class SeeRunExport(L.Callback):
    """What a rank process Lightning launched at this point would inherit."""

    def on_train_start(self, trainer, pl_module):
        self.seen = os.environ.get(RUN_ID_ENV)


def test_the_run_is_exported_to_its_ranks_only_while_it_trains(tiny_recipe, workdir):
    """A later run of this process, or a process it starts after, must not take this run's folder."""
    recipe = load_recipe(tiny_recipe, ["trainer.max_steps=1"])
    assert open_run(recipe.name, None) and RUN_ID_ENV not in os.environ  # picking a run exports nothing
    seen = SeeRunExport()
    _, run = train(recipe, extra_callbacks=[seen])
    assert seen.seen == run.run_id
    assert RUN_ID_ENV not in os.environ and RESUME_ENV not in os.environ
    _, again = train(recipe)
    assert again.dir != run.dir
