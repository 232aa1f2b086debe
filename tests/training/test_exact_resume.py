"""Exact mid-epoch resume: a run stopped at step k of an epoch and resumed reads exactly the samples that
epoch had not reached (none twice, none missed), continues the LR schedule and random streams, and ends
with the weights of the uninterrupted run — for every-task and sampled multi-task schedules and with
gradient accumulation."""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
import torch

from mmformer.commands.train import train
from mmformer.data.datamodule import EveryTask
from mmformer.data.samplers import ResumableShardSampler
from mmformer.data.task_schedule import SampledTasks
from mmformer.recipe import load_recipe
from mmformer.training.preemption import Preempted
from tests.conftest import make_image_folder
from tests.multitask.test_joint_training import JOINT


class PreemptAtStep(L.Callback):
    """Sends this process SIGTERM after the batch that ends optimizer step ``step``: the run writes
    ``last.ckpt`` mid-epoch at the end of the next step (or accumulation window) and stops."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class SeenSamples(L.Callback):
    """The first token / pixel sum of every training sample, per epoch, as the step saw it."""

    def __init__(self):
        self.seen: dict[int, list] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        for name, b in batch.items():
            if name in pl_module.tasks and b is not None:
                key = b["text"][:, :8] if "text" in b else b["image"].flatten(1)[:, :40]
                self.seen.setdefault(trainer.current_epoch, []).extend(
                    (name, tuple(round(float(v), 4) for v in row)) for row in key
                )


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}


@pytest.mark.parametrize(
    "overrides",
    [  # ~10-30 s each: the cheapest (augment-workers, the one with the most to restore) stays fast
        pytest.param(["multitask.schedule=all"], marks=pytest.mark.slow),
        pytest.param(["multitask.schedule=sampled", "multitask.steps_per_epoch=7"], marks=pytest.mark.slow),
        pytest.param(["multitask.schedule=all", "trainer.accumulate_grad_batches=2"], marks=pytest.mark.slow),
        # augmented images prepared by 2 loader workers: the resumed epoch draws the same crops and flips
        [
            "tasks.shapes.data.num_workers=2",
            "tasks.shapes.data.crop_padding=3",
            "tasks.shapes.data.hflip=true",
            "tasks.shapes.data.batch_size=2",
        ],
    ],
    ids=["every-task", "sampled", "accumulate", "augment-workers"],
)
def test_stop_mid_epoch_and_resume_equals_uninterrupted(workdir, overrides):
    images = make_image_folder(workdir / "images", n_per_class=6)
    docs = [f"Chapter {i}\nAnd the light was good, and the day was {i}.\nAnd it was so." for i in range(40)]
    corpus = workdir / "corpus.txt"
    corpus.write_text("\n\n".join(docs) + "\n")
    (workdir / "joint.yaml").write_text(JOINT.format(images=images, corpus=corpus))
    base = [*overrides, "trainer.max_epochs=2", "logger.mode=disabled", "trainer.log_every_n_steps=1"]

    seen_full = SeenSamples()
    full, _ = train(load_recipe(workdir / "joint.yaml", [*base, "name=full"]), [seen_full])
    steps = full.global_step
    stop = steps // 4 + 1  # inside epoch 0, not at a window boundary of every layout
    seen_a, seen_b = SeenSamples(), SeenSamples()
    with pytest.raises(Preempted):
        train(load_recipe(workdir / "joint.yaml", [*base, "name=part"]), [PreemptAtStep(stop), seen_a])
    (last,) = (workdir / "runs" / "part").glob("*/checkpoints/last.ckpt")
    saved = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    assert stop <= saved < steps // 2  # stopped inside epoch 0
    if "tasks.shapes.data.num_workers=2" in overrides:  # inside a pass of the image loader, where its
        assert saved % len(full.train_dataloader.steps.loaders["shapes"]) != 0  # workers' streams restart
    resumed, _ = train(load_recipe(workdir / "joint.yaml", [*base, "name=part", "resume=auto"]), [seen_b])
    assert resumed.global_step == steps

    # epoch 0 across the interruption = epoch 0 uninterrupted: every sample once, in the same order
    assert seen_a.seen[0] + seen_b.seen.get(0, []) == seen_full.seen[0]
    assert seen_b.seen[1] == seen_full.seen[1]
    lr = resumed.optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(full.optimizers[0].param_groups[0]["lr"])
    w_full, w_resumed = _weights(full), _weights(resumed)
    for k, v in w_full.items():
        torch.testing.assert_close(w_resumed[k], v, atol=1e-6, rtol=0, msg=k)


def test_samplers_and_schedules_start_part_way():
    data = list(range(23))
    sampler = ResumableShardSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=True)
    full = list(sampler)
    sampler.skip(4)
    assert list(sampler) == full[4:] and list(sampler) == full  # one pass only

    def loaders():
        out = {}
        for name, n in (("a", 12), ("b", 5)):
            s = ResumableShardSampler(list(range(n)), num_replicas=1, rank=0, shuffle=True, seed=0)
            out[name] = torch.utils.data.DataLoader(list(range(n)), batch_size=2, sampler=s, drop_last=True)
        return out

    every = [{k: v.tolist() for k, v in step.items()} for step in EveryTask(loaders())]
    assert len(every) == 6
    # "b" (2 batches) cycles 3 times while "a" takes 6 steps: each pass a fresh shuffle of its samples
    passes = [sorted(sum((s["b"] for s in every[k : k + 2]), [])) for k in (0, 2, 4)]
    orders = [sum((s["b"] for s in every[k : k + 2]), []) for k in (0, 2, 4)]
    assert all(len(set(p)) == 4 for p in passes) and len({tuple(o) for o in orders}) == 3
    for start in range(6):
        assert [
            {k: v.tolist() for k, v in s.items()} for s in EveryTask(loaders()).iter_from(start)
        ] == every[start:]

    sampled = SampledTasks(loaders(), steps=15, seed=1)
    order = [{k: v.tolist() for k, v in s.items()} for s in sampled]
    for start in (0, 3, 9, 14):
        again = SampledTasks(loaders(), steps=15, seed=1)
        assert [{k: v.tolist() for k, v in s.items()} for s in again.iter_from(start)] == order[start:]


class _Noise(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.rand(())  # drawn in the worker, from its stream


def _worker_draws(rank: int, epoch: int) -> list[float]:
    sampler = ResumableShardSampler(_Noise(), num_replicas=2, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    loader = torch.utils.data.DataLoader(
        _Noise(), batch_size=2, sampler=sampler, num_workers=2, generator=sampler.generator
    )
    return [round(float(v), 6) for b in loader for v in b]


def test_loader_workers_get_distinct_epoch_dependent_reproducible_streams():
    draws = {(r, e): _worker_draws(r, e) for r in (0, 1) for e in (0, 1)}
    assert _worker_draws(1, 1) == draws[1, 1]  # reproducible
    assert draws[0, 0] != draws[1, 0] and draws[0, 0] != draws[0, 1]  # per rank, per epoch
    first, second = draws[0, 0][:2], draws[0, 0][2:4]  # batches 0 and 1 come from workers 0 and 1
    assert first != second


def test_a_checkpoint_without_the_datamodule_state_resumes_mid_epoch_too(tiny_recipe, workdir):
    """Checkpoints written before the datamodule carried the loader's position hold it only in
    Lightning's loop state: resuming one continues the epoch where it stopped, not from its start."""
    base = ["trainer.max_epochs=1", "logger.mode=disabled"]
    seen_full, seen_a, seen_b = SeenSamples(), SeenSamples(), SeenSamples()
    train(load_recipe(tiny_recipe, [*base, "name=full"]), [seen_full])
    with pytest.raises(Preempted):
        train(load_recipe(tiny_recipe, [*base, "name=part"]), [PreemptAtStep(1), seen_a])
    (last,) = (workdir / "runs" / "part").glob("*/checkpoints/last.ckpt")
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt.pop("MultiTaskDataModule")  # as an older checkpoint: the position only in the loop state
    torch.save(ckpt, last)
    train(load_recipe(tiny_recipe, [*base, "name=part", "resume=auto"]), [seen_b])
    assert seen_a.seen[0] + seen_b.seen[0] == seen_full.seen[0]
