"""A NaN / inf loss skips the update on every rank (weights and AdamW moments untouched), is counted
and warned about; too many in a row stop the run with a clear message. Out-of-memory steps name the
task and the batch shapes."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp

from mmformer.commands.train import train
from mmformer.recipe import load_recipe
from mmformer.tasks.classification import ClassificationTask
from mmformer.tasks.router import all_finite
from mmformer.training.preemption import Preempted
from tests.training.test_logged_history import csv_rows


class Snapshots(L.Callback):
    def __init__(self):
        self.before, self.after = {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[batch_idx] = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[batch_idx] = [p.detach().clone() for p in pl_module.parameters()]


def _poison(monkeypatch, bad_steps: set[int], value=float("nan")):
    original = ClassificationTask.training_loss
    calls = {"n": 0}

    def training_loss(self, model, batch):
        loss = original(self, model, batch)
        step, calls["n"] = calls["n"], calls["n"] + 1
        return loss * value if step in bad_steps else loss

    monkeypatch.setattr(ClassificationTask, "training_loss", training_loss)


def test_a_nan_step_leaves_the_weights_untouched_and_training_goes_on(tiny_recipe, monkeypatch):
    _poison(monkeypatch, {1, 2})
    snaps = Snapshots()
    recipe = load_recipe(tiny_recipe, ["trainer.max_epochs=1"])  # 4 steps
    with pytest.warns(UserWarning, match="NaN / inf"):
        trainer, run = train(recipe, extra_callbacks=[snaps])
    module = trainer.lightning_module
    assert module.nonfinite_steps == 2 and module.nonfinite_in_a_row == 0
    for step in (1, 2):  # skipped: bit-identical weights
        for a, b in zip(snaps.before[step], snaps.after[step], strict=True):
            assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(snaps.before[3], snaps.after[3], strict=True))
    assert all(torch.isfinite(p).all() for p in module.parameters())
    # the rows of the skipped steps say so and carry no gradient norm (not the last good step's repeated)
    rows = {int(r["step"]): r for r in csv_rows(run.dir) if "train/loss" in r}
    assert [("train/grad_norm" in rows[s], rows[s].get("train/nonfinite_steps")) for s in range(4)] == [
        (True, None),
        (False, "1.0"),
        (False, "2.0"),
        (True, None),
    ]


def test_too_many_in_a_row_stop_the_run_with_a_clear_message(tiny_recipe, monkeypatch):
    _poison(monkeypatch, set(range(100)), value=float("inf"))
    recipe = load_recipe(tiny_recipe, ["trainer.max_epochs=2", "optim.max_nonfinite_steps=3"])
    with pytest.warns(UserWarning), pytest.raises(FloatingPointError, match="3 steps in a row.*tasks toy"):
        train(recipe)


W = 2


def _worker(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=W)

    def reduce(t, reduce_op="sum"):  # what DDPStrategy.reduce does with "sum"
        dist.all_reduce(t)
        return t

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("nan") if rank == 0 else 2.0, 3.0])  # only rank 0 is bad
    q = torch.nn.Parameter(torch.ones(2))
    q.grad = torch.ones(2)
    torch.save({"bad": all_finite([p, q], reduce), "good": all_finite([q], reduce)}, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_skips_when_one_rank_is_not_finite(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path / "out")), nprocs=W, join=True)
    for r in range(W):
        assert torch.load(tmp_path / f"out.{r}", weights_only=True) == {"bad": False, "good": True}


def test_out_of_memory_names_the_task_and_the_batch(tiny_recipe, monkeypatch):
    def oom(self, model, batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(ClassificationTask, "training_loss", oom)
    recipe = load_recipe(tiny_recipe, ["trainer.max_epochs=1"])
    with pytest.raises(torch.OutOfMemoryError, match=r"task 'toy'.*image \(4, 1, 28, 28\).*batch_size"):
        train(recipe)


class SigtermAt(L.Callback):
    """Sends this process SIGTERM (as a preemption would) during training step ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_last_checkpoint_after_the_current_step_and_resume_continues(tiny_recipe, workdir):
    recipe = load_recipe(tiny_recipe, ["trainer.max_epochs=2"])  # 4 steps per epoch
    with pytest.raises(Preempted):
        train(recipe, extra_callbacks=[SigtermAt(5)])  # mid-epoch 1, between validations
    (run,) = (workdir / "runs" / "tiny").iterdir()
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 6  # the step in flight finished, then the state was saved
    trainer, run2 = train(load_recipe(tiny_recipe, ["trainer.max_epochs=2", "resume=auto"]))
    assert run2.dir == run and trainer.global_step == 8
