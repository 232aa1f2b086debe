"""A signal sent to a real 2-process DDP run (as a scheduler's preemption or ``kill`` does): every rank
stops at the same step with one saved ``last.ckpt``, the command exits 128 + signal and says how to
continue, and the resumed run ends with the weights of the uninterrupted one. Each launch is bounded:
a hang fails the test instead of blocking the suite."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from mmformer.commands.train import train
from mmformer.recipe import load_recipe
from mmformer.training.preemption import Preempted

EPOCHS = 12  # 2 steps per epoch on 2 ranks (16 images, batch 4), a validation and last.ckpt after each
ARGS = [
    "trainer.devices=2",
    "trainer.strategy=ddp",
    f"trainer.max_epochs={EPOCHS}",
    "optim.warmup_steps=0",
]


def _launch(recipe: Path, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "mmformer.cli", "train", str(recipe), *ARGS, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _children(pid: int) -> list[int]:
    """The rank processes Lightning started from rank 0 (``/proc``; Linux)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids if "mmformer.cli" in Path(f"/proc/{k}/cmdline").read_text()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-process run: its final weights."""
    from tests.conftest import TINY_RECIPE, make_image_folder

    root = tmp_path_factory.mktemp("reference")
    recipe = root / "tiny.yaml"
    recipe.write_text(TINY_RECIPE.format(name="tiny", root=make_image_folder(root / "images")))
    env_runs = os.environ.get("MMFORMER_RUNS")
    os.environ["MMFORMER_RUNS"] = str(root / "runs")
    try:
        proc = _launch(recipe)
        out, err = proc.communicate(timeout=300)
    finally:
        os.environ.pop("MMFORMER_RUNS") if env_runs is None else os.environ.update(MMFORMER_RUNS=env_runs)
    assert proc.returncode == 0, err[-3000:]
    (last,) = (root / "runs" / "tiny").glob("*/checkpoints/last.ckpt")
    return _weights(last)


@pytest.mark.slow
@pytest.mark.parametrize("who", ["rank0", "rank1", "all"])
def test_sigterm_stops_every_rank_at_one_step_and_resumes_exactly(tiny_recipe, workdir, reference, who):
    proc = _launch(tiny_recipe)
    try:
        deadline = time.monotonic() + 180
        ckpts = workdir / "runs" / "tiny"
        while not list(ckpts.glob("*/checkpoints/last.ckpt")):  # training is under way on both ranks
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        (rank1,) = _children(proc.pid)
        targets = {"rank0": [proc.pid], "rank1": [rank1], "all": [proc.pid, rank1]}[who]
        for pid in targets:
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=90)  # a deadlock fails here
        for _ in range(200):  # rank 1 exits at the same point as rank 0
            if not _alive(rank1):
                break
            time.sleep(0.05)
        assert not _alive(rank1)
    finally:
        if proc.poll() is None:
            proc.kill()

    assert proc.returncode == 143, err[-3000:]
    m = re.search(r"stopped by SIGTERM at step (\d+); saved (\S+)\ncontinue with: (.*)", out)
    assert m, out[-2000:] + err[-2000:]
    step, saved = int(m.group(1)), Path(m.group(2))
    assert m.group(3).endswith("resume=auto")
    assert step < 2 * EPOCHS  # stopped early, not at the end
    (run,) = ckpts.iterdir()
    assert saved == run / "checkpoints" / "last.ckpt"
    assert torch.load(saved, map_location="cpu", weights_only=True)["global_step"] == step
    assert not list((run / "checkpoints").glob(".*.tmp"))

    resumed = _launch(tiny_recipe, "resume=auto")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert [p.name for p in ckpts.iterdir()] == [run.name]  # continued in the same run folder
    weights = _weights(run / "checkpoints" / "last.ckpt")
    for k, v in reference.items():
        torch.testing.assert_close(weights[k], v, atol=1e-6, rtol=0, msg=k)


# Two Ctrl-C presses inside one step, as the terminal sends them: two real SIGINTs to the process itself
# while it trains step 3, before its safe point (sent from outside, two signals 10 ms apart can reach a
# process the loaded machine has not scheduled in between as one: pending signals do not queue).
TWICE = """
import os, signal, sys
import lightning as L
from mmformer.cli import main
import mmformer.commands.train as train_command


class CtrlCTwice(L.Callback):
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs as os.kill returns: stop at the safe point
            os.kill(os.getpid(), signal.SIGINT)  # the second: KeyboardInterrupt, here and now


plain = train_command.train
train_command.train = lambda recipe, extra_callbacks=(), verbose=False: plain(
    recipe, [*extra_callbacks, CtrlCTwice()], verbose
)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_ctrl_c_saves_and_says_how_to_continue_and_a_second_one_stops_at_once(tiny_recipe, workdir):
    overrides = ["trainer.devices=1", "trainer.strategy=auto", "trainer.max_epochs=400"]
    proc = _launch(tiny_recipe, *overrides, "name=once")
    try:
        deadline = time.monotonic() + 120
        while not list((workdir / "runs" / "once").glob("*/checkpoints/last.ckpt")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "SIGINT received: stopping at the next safe point" in err
    m = re.search(r"stopped by SIGINT at step (\d+); saved (\S+)\ncontinue with: .* resume=auto", out)
    assert m, out[-2000:]
    assert torch.load(m.group(2), map_location="cpu", weights_only=True)["global_step"] == int(m.group(1))

    # the second Ctrl-C does not wait for the safe point (KeyboardInterrupt), and the run is not "done"
    args = [sys.executable, "-c", TWICE, "train", str(tiny_recipe), *ARGS, *overrides, "name=twice"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 1, done.stderr[-3000:]  # Lightning's exit on KeyboardInterrupt
    assert "SIGINT received: stopping at the next safe point" in done.stderr
    assert "Detected KeyboardInterrupt" in done.stderr and "stopped by SIGINT" not in done.stdout
    assert not list((workdir / "runs" / "twice").glob("*/checkpoints/last.ckpt"))  # nothing saved at step 3


class SigtermDuringValidation(L.Callback):
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_during_validation_lets_it_finish_and_stops_right_after(tiny_recipe, workdir):
    recipe = load_recipe(tiny_recipe, ["trainer.max_epochs=3", "checkpoint.save_top_k=1"])  # 4 steps an epoch
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as stop:
        train(recipe, extra_callbacks=[SigtermDuringValidation()])
    assert (stop.value.signum, stop.value.step, stop.value.exit_code) == (signal.SIGTERM, 4, 143)
    (run,) = (workdir / "runs" / "tiny").iterdir()
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["best-epoch000-step000004.ckpt", "last.ckpt"]  # the validation completed and scored
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert signal.getsignal(signal.SIGTERM) == before  # the handlers are given back

    resumed, _ = train(load_recipe(tiny_recipe, ["trainer.max_epochs=3", "resume=auto"]))
    full, _ = train(load_recipe(tiny_recipe, ["trainer.max_epochs=3", "name=full"]))
    assert resumed.global_step == full.global_step == 12
    w_full = full.lightning_module.state_dict()
    for k, v in resumed.lightning_module.state_dict().items():
        torch.testing.assert_close(v, w_full[k], atol=1e-6, rtol=0, msg=k)


def test_a_finished_run_gives_the_signal_handlers_back(tiny_recipe, workdir):
    """Lightning puts back its own handlers before the callbacks' teardown: a run that ends normally must
    not leave Lightning's broadcasting SIGTERM handler (or this one) installed behind it."""
    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    train(load_recipe(tiny_recipe, ["trainer.max_epochs=1"]))
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


class SigtermOnFirstBatch(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0 and trainer.current_epoch == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_inside_the_first_accumulation_window_stops_at_its_end(tiny_recipe, workdir):
    recipe = load_recipe(tiny_recipe, ["trainer.max_epochs=2", "trainer.accumulate_grad_batches=2"])
    with pytest.raises(Preempted) as stop:
        train(recipe, extra_callbacks=[SigtermOnFirstBatch()])
    assert stop.value.step == 1  # the window of batches 0 and 1 was applied, then the run stopped
    assert torch.load(stop.value.checkpoint, weights_only=True)["global_step"] == 1
