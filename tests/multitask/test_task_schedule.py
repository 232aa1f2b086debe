"""Sampled multi-task schedules: one task per step, drawn with the given weights, reproducible from
(seed, epoch), the same on every rank by default; each task's data is seen once per pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from mmformer.data.task_schedule import SampledTasks


def _loaders(sizes=(("a", 24), ("b", 8)), batch=4, world=1, rank=0):
    out = {}
    for k, (name, n) in enumerate(sizes):
        ds = TensorDataset(torch.arange(n) + 1000 * k)
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
        out[name] = DataLoader(ds, batch_size=batch, sampler=sampler)
    return out


def _steps(tasks, epoch=0):
    tasks.epoch = lambda: epoch
    return [(name, batch[0].tolist()) for step in tasks for name, batch in step.items()]


def test_default_weights_and_length_follow_the_loaders():
    tasks = SampledTasks(_loaders())
    assert len(tasks) == 6 + 2  # 24 / 4 + 8 / 4 batches
    np.testing.assert_allclose(tasks.probs, [6 / 8, 2 / 8])
    steps = _steps(tasks)
    assert len(steps) == 8 and all(len(b) == 4 for _, b in steps)


def test_draw_frequencies_match_the_weights():
    tasks = SampledTasks(_loaders(), weights={"a": 1, "b": 3}, steps=4000)
    names = tasks.schedule(0)
    share_b = names.count("b") / len(names)
    assert share_b == pytest.approx(0.75, abs=3 * np.sqrt(0.75 * 0.25 / 4000))  # within 3 sigma


def test_a_task_sees_every_sample_once_per_pass_then_reshuffles():
    tasks = SampledTasks(_loaders(), weights={"a": 0, "b": 1}, steps=4)  # b only: 2 passes of 2 batches
    steps = _steps(tasks)
    first, second = steps[:2], steps[2:]
    seen1 = sorted(x for _, b in first for x in b)
    seen2 = sorted(x for _, b in second for x in b)
    assert seen1 == seen2 == list(range(1000, 1008))  # every sample exactly once in each pass
    assert [b for _, b in first] != [b for _, b in second]  # the second pass is shuffled anew


def test_reproducible_per_epoch_and_different_across_epochs():
    a = _steps(SampledTasks(_loaders(), steps=30), epoch=3)
    b = _steps(SampledTasks(_loaders(), steps=30), epoch=3)
    c = _steps(SampledTasks(_loaders(), steps=30), epoch=4)
    assert a == b and a != c


def test_ranks_agree_on_the_task_unless_told_not_to():
    same = [SampledTasks(_loaders(world=2, rank=r), steps=50).schedule(0) for r in (0, 1)]
    assert same[0] == same[1]
    own = [
        SampledTasks(_loaders(world=2, rank=r), steps=50, same_on_all_ranks=False, rank=r).schedule(0)
        for r in (0, 1)
    ]
    assert own[0] != own[1]
    # ranks read disjoint shards of the task they train
    steps = [
        _steps(SampledTasks(_loaders(world=2, rank=r), weights={"a": 1, "b": 0}, steps=3)) for r in (0, 1)
    ]
    rank0 = {x for _, b in steps[0] for x in b}
    rank1 = {x for _, b in steps[1] for x in b}
    assert not rank0 & rank1 and rank0 | rank1 == set(range(24))


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="unknown tasks"):
        SampledTasks(_loaders(), weights={"a": 1, "c": 1})
    with pytest.raises(ValueError, match="not all 0"):
        SampledTasks(_loaders(), weights={"a": 0, "b": 0})
