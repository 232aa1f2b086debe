"""Cross-task leakage check for multi-task recipes: no task's validation (test) samples may be any
task's training samples. Samples are compared by content, not by name: a file by the BLAKE2b digest of
its bytes (a copy under another root is still the same image or clip), a text (a corpus document, a
caption, a transcript) by its whitespace-normalised string.

A dataset declares its samples' sources through ``TaskData.train_sources`` / ``val_sources``: file
paths, or ``"text:" + text``. Data without sources (a torchvision dataset) is not checked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from .roots import DataError

TEXT = "text:"


def text_source(text: str) -> str:
    """The source key of a text: ``"text:"`` + its whitespace-normalised form."""
    return TEXT + " ".join(text.split())


def _digest(source: str, cache: dict[str, str]) -> str:
    if source.startswith(TEXT):
        return source
    if source not in cache:
        h = hashlib.blake2b(digest_size=16)
        with open(source, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        cache[source] = "file:" + h.hexdigest()
    return cache[source]


def _fingerprints(sources: Iterable[str], cache: dict[str, str]) -> dict[str, str]:
    """digest → one source with that digest (for the error message)."""
    out: dict[str, str] = {}
    for s in sources:
        try:
            out.setdefault(_digest(s, cache), s)
        except OSError:  # unreadable files are reported by the dataset when read
            continue
    return out


def check_no_leaks(sources: dict[str, tuple[list[str] | None, list[str] | None]], show: int = 3) -> None:
    """``sources``: task → (train sources, validation sources). Raises ``DataError`` naming each pair
    (validation task, training task) that shares samples, with their count and a few examples."""
    cache: dict[str, str] = {}
    train = {n: _fingerprints(t, cache) for n, (t, _) in sources.items() if t is not None}
    problems = []
    for val_task, (_, val) in sources.items():
        if val is None:
            continue
        held_out = _fingerprints(val, cache)
        for train_task, seen in train.items():
            shared = [held_out[d] for d in held_out.keys() & seen.keys()]
            if shared:
                examples = ", ".join(
                    Path(s).name if not s.startswith(TEXT) else repr(s[5:65]) for s in sorted(shared)[:show]
                )
                problems.append(
                    f"{len(shared)} validation samples of task {val_task!r} are training samples of task "
                    f"{train_task!r} (e.g. {examples})"
                )
    if problems:
        raise DataError(
            "test data reaches training data: "
            + "; ".join(problems)
            + ". Use disjoint splits (or set multitask.check_leaks: false if this is intended)"
        )
