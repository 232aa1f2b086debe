"""A run killed with SIGKILL at several points (mid-step, right after a checkpoint written inside a
step, right after one written after a validation, during a validation) and resumed with
``resume=auto`` leaves the same logged history as an uninterrupted run, in ``metrics.csv`` and in the
offline W&B records: every validation once, steps increasing, no row twice, W&B's ``_step`` continuing
across segments. The kill is a real SIGKILL of the training process (no handler, no flush), sent from
inside at a chosen hook so the point is exact."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tests.conftest import TINY_RECIPE, make_image_folder
from tests.training.test_logged_history import csv_rows, wandb_rows

pytestmark = pytest.mark.slow

# 40 optimizer steps (2 epochs of 20), validation every 5 steps, last.ckpt every 4 steps: the one at
# step 20 (and 40) coincides with a validation and is written after it; the others inside the step.
OVERRIDES = [
    "trainer.max_epochs=2",
    "trainer.val_check_interval=5",
    "checkpoint.every_n_train_steps=4",
    "logger.mode=offline",
]

LAUNCH = """
import os, signal, sys
import lightning as L
from mmformer.cli import main
import mmformer.commands.train as train_command

hook, step = os.environ["KILL_AT"].split(":")
step = int(step)


class KillAt(L.Callback):
    def _maybe(self, trainer, name):
        if name == hook and trainer.global_step == step and not trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_start(self, trainer, *args):
        self._maybe(trainer, "batch_start")

    def on_before_optimizer_step(self, trainer, *args):
        self._maybe(trainer, "mid_step")

    def on_validation_batch_end(self, trainer, *args):
        self._maybe(trainer, "validation")


plain = train_command.train
train_command.train = lambda recipe, extra_callbacks=(), verbose=False: plain(
    recipe, [*extra_callbacks, KillAt()], verbose
)
sys.exit(main(sys.argv[1:]))
"""


def _train(workdir, recipe, *extra, kill: str | None = None) -> int:
    env = dict(os.environ, MMFORMER_RUNS=str(workdir / "runs"), KILL_AT=kill or "none:-1")
    env.pop("WANDB_MODE", None)
    args = [sys.executable, "-c", LAUNCH, "train", str(recipe), *OVERRIDES, *extra]
    done = subprocess.run(args, env=env, cwd=workdir, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, -9), done.stderr[-3000:]
    return done.returncode


SPEED = ("throughput/", "memory/")  # rates need a window of steps: the first rows after a resume lack them


def _comparable(row: dict) -> dict:
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(SPEED) and k not in ("_step", "_runtime", "_timestamp")
    }


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b), (len(a), len(b))
    for x, y in zip(a, b):
        x, y = _comparable(x), _comparable(y)
        assert set(x) == set(y), (sorted(set(x) ^ set(y)), x.get("step", x.get("trainer/global_step")))
        for k in x:
            if isinstance(x[k], (int, float)) and isinstance(y[k], (int, float)):
                assert math.isclose(float(x[k]), float(y[k]), rel_tol=1e-4, abs_tol=1e-5), (k, x, y)
            elif isinstance(x[k], str) and isinstance(y[k], str):
                try:
                    assert math.isclose(float(x[k]), float(y[k]), rel_tol=1e-4, abs_tol=1e-5), (k, x[k], y[k])
                except ValueError:
                    assert x[k] == y[k], k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("whole")
    recipe = _recipe(workdir)
    assert _train(workdir, recipe) == 0
    run = next((workdir / "runs" / "hist").iterdir())
    return csv_rows(run), wandb_rows(run)


def _recipe(workdir):
    folder = make_image_folder(workdir / "images", n_per_class=40)
    path = workdir / "hist.yaml"
    path.write_text(TINY_RECIPE.format(name="hist", root=folder))
    return path


@pytest.mark.parametrize(
    "kill",
    [
        "mid_step:13",  # inside step 14, after its backward: last.ckpt holds step 12
        "batch_start:9",  # right after last.ckpt at step 8 (written inside that step, before its row)
        "batch_start:21",  # right after last.ckpt at step 20 (written after that step's validation)
        "validation:15",  # during the validation after step 15: last.ckpt holds step 12
    ],
)
def test_a_killed_and_resumed_run_logs_the_uninterrupted_history(tmp_path, uninterrupted, kill):
    recipe = _recipe(tmp_path)
    assert _train(tmp_path, recipe, kill=kill) == -9  # SIGKILL
    assert _train(tmp_path, recipe, "resume=auto") == 0
    (run,) = (tmp_path / "runs" / "hist").iterdir()
    csv_whole, wandb_whole = uninterrupted
    rows = csv_rows(run)
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(steps)
    validations = [int(r["step"]) for r in rows if "val/toy/acc" in r]
    assert validations == [int(r["step"]) for r in csv_whole if "val/toy/acc" in r]  # each once
    _same(rows, csv_whole)

    history = wandb_rows(run)
    assert len(list(run.glob("wandb/offline-run-*"))) == 2  # the killed segment and the resumed one
    assert [r["_step"] for r in history] == list(range(len(history)))  # _step continues across segments
    _same(history, wandb_whole)
