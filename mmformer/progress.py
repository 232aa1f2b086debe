"""Progress bars for the long steps — ``data prepare`` of the bundled sets, BPE training, the token
cache, ``data shard``, weight import, sampling and evaluation — with one rule everywhere.

A bar is drawn (tqdm, on standard error) when standard error is a terminal, on the first process of a
multi-process run only; a pipe or a log file gets none, so logs stay readable. ``MMFORMER_PROGRESS=1``
forces bars on (to watch a job's log), ``MMFORMER_PROGRESS=0`` turns them off. Training and validation
draw Lightning's own bar (``mmformer.build.trainer.progress_bars``).

A leaf: imports tqdm only, so the model library (``nn``, ``tokenizers``, ``models``) may use it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from tqdm import tqdm

ENV = "MMFORMER_PROGRESS"
_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def setting() -> bool | None:
    """``MMFORMER_PROGRESS``: True (bars on), False (off) or None (unset: the terminal decides)."""
    value = os.environ.get(ENV, "").strip().lower()
    return True if value in _ON else False if value in _OFF else None


def forced() -> bool | None:
    """:func:`setting`, but False on every process of a multi-process run but the first."""
    if any(os.environ.get(v, "0") != "0" for v in ("RANK", "LOCAL_RANK", "SLURM_PROCID")):
        return False
    return setting()


def shows() -> bool:
    """Whether a bar would be drawn now (for libraries with their own bar, such as HF ``tokenizers``
    trainers' ``show_progress``)."""
    on = forced()
    if on is not None:
        return on
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def progress(
    iterable: Iterable | None = None, desc: str | None = None, total: float | None = None, **kwargs
) -> tqdm:
    """``tqdm(iterable, desc, total, **kwargs)`` under the rule above: also a context manager with
    ``update(n)`` for work that is not a loop (bytes, tokens). ``kwargs`` are tqdm's (``unit``,
    ``unit_scale``, ``leave``, …)."""
    on = forced()
    return tqdm(iterable, desc=desc, total=total, disable=None if on is None else not on, **kwargs)
