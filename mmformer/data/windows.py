"""Gradient-accumulation windows, known before their first micro-batch is trained.

A task's loss is a mean over its units (target tokens of a language model, samples of a classifier).
Averaging the means of ``K`` micro-batches weights a short-text micro-batch as much as a long one, so
the accumulated update is not the full-batch gradient (the bug fixed in HF transformers 4.46, which
counts the window's items up front, as here). ``AccumulationWindows`` reads each window of ``K`` steps
ahead and attaches, to every step, the totals of its window: per task, the number of micro-batches
that hold it and the units they hold. ``MultiTaskModule`` scales each micro-batch's loss with them
(and the same totals summed over ranks), so the update equals the gradient of the token-weighted
mean over the whole window — every rank, every micro-batch, the last partial window included.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

WINDOW = "__window__"  # the key of a step's window totals (not a task name: tasks are recipe identifiers)


class AccumulationWindows:
    """Steps of ``steps`` (an iterable of ``{task: batch | None}`` with a ``len``), each with
    ``step[WINDOW] = {"index": i, "size": j, "tasks": {task: [micro-batches, units]}, "units": {task:
    units}}`` added: ``i`` its place in its window, ``j`` the window's number of steps (``size`` except
    the last), the window's totals per task, and the step's own units per task (counted here, on the
    host, so the training step needs no device synchronisation to know them).

    Args:
        steps: the training steps of one epoch.
        size: ``trainer.accumulate_grad_batches``.
        units: task name → the number of units its training loss averages in a batch.
        limit: steps of this epoch the trainer takes (``limit_train_batches``), so the last window is
            cut where the trainer cuts it; None: all.
        progress: returns ``(epoch, steps of it trained)`` — the trainer's count, not this reader's,
            which runs a window ahead. ``state_dict()`` saves it with every checkpoint (Lightning's
            stateful-loader protocol); after ``load_state_dict``, the pass of that same epoch starts at
            that step (``steps.iter_from``), reading only the samples the epoch had not reached.
            Windows stay aligned to multiples of ``size`` from the start of the epoch, as the trainer's are.
    """

    def __init__(
        self,
        steps: Iterable[dict],
        size: int,
        units: dict[str, Callable[[dict], int]],
        limit: int | None = None,
        progress: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ):
        if size < 1:
            raise ValueError(f"accumulation window size must be >= 1, got {size}")
        self.steps, self.size, self.units, self.limit = steps, size, units, limit
        self.progress = progress
        self._resume: dict | None = None

    def state_dict(self) -> dict:
        epoch, done = self.progress()
        return {"epoch": epoch, "steps": done}

    def load_state_dict(self, state: dict) -> None:
        self._resume = dict(state)

    def _start(self) -> int:
        resume, self._resume = self._resume, None
        return int(resume["steps"]) if resume and resume["epoch"] == self.progress()[0] else 0

    def __len__(self) -> int:
        n = len(self.steps)
        return n if self.limit is None else min(n, self.limit)

    def __iter__(self) -> Iterator[dict]:
        begin = self._start()
        it = self.steps.iter_from(begin) if begin else iter(self.steps)
        at, end = begin, len(self)
        while at < end:
            size = min(self.size - at % self.size, end - at)  # up to the next multiple of ``size``
            window = list(itertools.islice(it, size))
            if not window:
                return
            at += len(window)
            totals: dict[str, list[int]] = {}
            units = []
            for step in window:
                units.append({n: int(self.units[n](b)) for n, b in step.items() if b is not None})
                for name, u in units[-1].items():
                    t = totals.setdefault(name, [0, 0])
                    t[0], t[1] = t[0] + 1, t[1] + u
            for i, step in enumerate(window):
                info = {"index": i, "size": len(window), "tasks": totals, "units": units[i]}
                yield {**step, WINDOW: info}
