"""One task per training step, drawn with fixed probabilities (PolyViT's task sampling,
Likhosherstov et al. 2021, §3.2), for recipes with ``multitask.schedule: sampled``.

Each task keeps its own ``DataLoader`` (with its ``DistributedSampler``); a step yields
``{task_name: batch}`` with exactly one task. The draw of epoch ``e`` is a function of
``(seed, e)`` — and of the rank when ranks draw independently — so a run resumed at an epoch
boundary replays the same tasks, and every rank agrees on the task (no rank waits for another
task's slower step) unless told otherwise. A task whose loader runs out mid-epoch starts its next
pass with a fresh shuffle (``set_epoch(epoch · 1000 + pass)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
from torch.utils.data import DataLoader

from .samplers import set_epoch, start_part_way


class SampledTasks:
    """An iterable over ``{task: batch}`` steps, one task per step.

    Args:
        loaders: task name → its training ``DataLoader`` (``len`` must be known).
        weights: task name → sampling weight (≥ 0, not all 0); default: ``len`` of each loader.
        steps: steps per epoch; default: the sum of the loaders' lengths.
        seed: the recipe's seed.
        rank: this process's rank (used only when ``same_on_all_ranks`` is False).
        same_on_all_ranks: every rank trains the same task at each step.
        epoch: returns the epoch about to start (the trainer's ``current_epoch``).

    Raises ``ValueError`` for weights that name unknown tasks or sum to zero.
    """

    def __init__(
        self,
        loaders: dict[str, DataLoader],
        weights: dict[str, float] | None = None,
        steps: int | None = None,
        seed: int = 0,
        rank: int = 0,
        same_on_all_ranks: bool = True,
        epoch: Callable[[], int] = lambda: 0,
    ):
        self.loaders = loaders
        self.names = list(loaders)
        raw = weights or {n: float(len(dl)) for n, dl in loaders.items()}
        unknown = set(raw) - set(self.names)
        if unknown:
            raise ValueError(f"sampling weights for unknown tasks: {sorted(unknown)}")
        w = np.array([float(raw.get(n, 0.0)) for n in self.names])
        if (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"sampling weights must be >= 0 and not all 0, got {raw}")
        self.probs = w / w.sum()
        self.steps = int(steps) if steps else sum(len(dl) for dl in loaders.values())
        self.seed, self.rank, self.same_on_all_ranks, self.epoch = seed, rank, same_on_all_ranks, epoch

    def __len__(self) -> int:
        return self.steps

    def schedule(self, epoch: int) -> list[str]:
        """The task of every step of ``epoch`` (on this rank)."""
        key = [self.seed, epoch] if self.same_on_all_ranks else [self.seed, epoch, self.rank]
        draws = np.random.default_rng(key).choice(len(self.names), size=self.steps, p=self.probs)
        return [self.names[i] for i in draws]

    def __iter__(self) -> Iterator[dict]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[dict]:
        """The steps of the current epoch from step ``start`` on: each task resumes the pass and the
        batch the first ``start`` steps had reached (nothing before is read)."""
        epoch = self.epoch()
        schedule = self.schedule(epoch)
        done = dict.fromkeys(self.names, 0)  # batches each task trained before ``start``
        for name in schedule[:start]:
            done[name] += 1
        iterators: dict[str, Iterator] = {}
        passes = {n: done[n] // max(1, len(self.loaders[n])) for n in self.names}
        for name in schedule[start:]:
            if name not in iterators:
                iterators[name] = self._start(name, epoch, passes[name], done[name] % len(self.loaders[name]))
            try:
                batch = next(iterators[name])
            except StopIteration:  # this task's data is used up: a new pass, freshly shuffled
                passes[name] += 1
                iterators[name] = self._start(name, epoch, passes[name])
                batch = next(iterators[name])
            yield {name: batch}

    def _start(self, name: str, epoch: int, n_pass: int, at: int = 0) -> Iterator:
        loader = self.loaders[name]
        if len(loader) == 0:
            raise ValueError(f"task {name!r} has no training batches (fewer samples than one batch?)")
        set_epoch(loader, epoch * 1000 + n_pass)
        return start_part_way(loader, at) if at else iter(loader)
