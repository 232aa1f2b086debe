"""Unreadable samples (docs/data.md, the folder rule): a bad file is named with its file, counted, replaced
where training can go on and left out of every evaluation metric.

* Training replaces an unreadable sample by the next readable one (``first_readable``), so batch shapes
  stay fixed and DDP ranks stay in step; the item lists what it stands in for under ``bad_samples``.
* Evaluation never substitutes: the replacement row is marked ``stand_in`` and the evaluation loaders'
  collate (``DropStandIns``) removes it after collation, so the neighbour is scored once, the bad sample
  not at all, and a batch whose samples were all unreadable has zero rows (with the usual shapes).
* Each file is named once per process (``report_unreadable``); ``BadSampleReport`` marks the paths it
  has seen as reported, so data-loader workers started later (training workers start afresh every
  epoch, forked from the main process) stay silent, and it prints the counts at the end of the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from .roots import DataError

log = logging.getLogger("mmformer.data")

MAX_CONSECUTIVE_BAD = 50  # a data set where this many in a row are unreadable is refused
STAND_IN = "stand_in"  # item key: this row replaces an unreadable sample (dropped in evaluation)

_reported: set[str] = set()  # the paths named in this process


def warn_once(key: str, message: str, *args) -> None:
    """``log.warning(message, *args)`` the first time this process meets ``key`` (a bad sample's path)."""
    if key in _reported:
        return
    _reported.add(key)
    log.warning(message, *args)


def report_unreadable(what: str, path: str, error: BaseException | str) -> None:
    """Warn ``unreadable <what> skipped: <path> (<error>)`` the first time this process meets ``path``."""
    reason = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error
    warn_once(path, "unreadable %s skipped: %s (%s)", what, path, reason)


def mark_reported(paths: Iterable[str]) -> None:
    """Paths already named (by another process): this one, and workers forked from it, stay silent."""
    _reported.update(paths)


def forget_reported() -> None:
    """A new run: every unreadable file is named again the first time it is met."""
    _reported.clear()


def first_readable(
    i: int,
    n: int,
    load: Callable[[int], object],
    path: Callable[[int], str],
    what: str,
    errors: tuple[type[BaseException], ...],
) -> tuple[int, object, list[str]]:
    """``(j, load(j), paths skipped)`` for the first ``j`` of ``i, i + 1, …`` (mod ``n``) that loads;
    each unreadable one is reported. Raises ``DataError`` after ``MAX_CONSECUTIVE_BAD`` in a row."""
    bad: list[str] = []
    for attempt in range(min(MAX_CONSECUTIVE_BAD, n)):
        j = (i + attempt) % n
        try:
            return j, load(j), bad
        except errors as e:
            report_unreadable(what, path(j), e)
            bad.append(path(j))
    raise DataError(
        f"{len(bad)} consecutive unreadable {what} files from {path(i)} on (each is named in a warning above)"
    )


def stand_in(item: dict, bad: list[str]) -> dict:
    """``item`` as the replacement of the unreadable samples ``bad``: kept in training, dropped in
    evaluation."""
    return {**item, "bad_samples": list(bad), STAND_IN: True}


def select_rows(batch: dict, keep: list[bool]) -> dict:
    """The rows ``keep`` of a collated batch: every tensor whose first dimension is the batch and every
    list of one entry per row; ``bad_samples`` (a list of paths, not of rows) and anything else as is."""
    n, mask = len(keep), torch.tensor(keep, dtype=torch.bool)
    out = {}
    for key, value in batch.items():
        if key == "bad_samples":
            out[key] = value
        elif torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n:
            out[key] = value[mask]
        elif isinstance(value, (list, tuple)) and len(value) == n:
            out[key] = type(value)(v for v, k in zip(value, keep) if k)
        else:
            out[key] = value
    return out


class DropStandIns:
    """An evaluation loader's collate: ``collate`` the items, then drop the rows that stand in for an
    unreadable sample (their paths stay under ``bad_samples``, counted as skipped). A batch of stand-ins
    only has zero rows."""

    def __init__(self, collate: Callable[[list[dict]], dict]):
        self.collate = collate

    def __call__(self, samples: list[dict]) -> dict:
        keep = [not s.get(STAND_IN, False) for s in samples]
        batch = self.collate([{k: v for k, v in s.items() if k != STAND_IN} for s in samples])
        if all(keep):
            return batch
        bad = [p for s in samples for p in s.get("bad_samples", [])]
        return {**select_rows(batch, keep), "bad_samples": list(dict.fromkeys(bad))}
