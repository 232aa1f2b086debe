"""Cross-task leakage check for multi-task recipes: no task's validation (test) samples may be another
task's training samples. Samples are compared by content, not by name: a file by the BLAKE2b digest of
its bytes (a copy under another root is still the same image or clip; only files whose size occurs on
both sides are read), a text that is itself the sample (a corpus document, a text to classify) by its
whitespace-normalised string. Captions and transcripts are not samples (two images may share one).
A task's own train / validation split is its dataset's business and is not compared.

A dataset declares its samples' sources through ``TaskData.train_sources`` / ``val_sources``: file
paths, or ``"text:" + text``. Data without sources (a torchvision dataset) is not checked.
"""

from __future__ import annotations

import hashlib
import os
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


def _size(source: str) -> int | None:
    if source.startswith(TEXT):
        return -1  # texts are compared by their (cheap) normalised string
    try:
        return os.path.getsize(source)
    except OSError:  # unreadable files are reported by the dataset when read
        return None


def _fingerprints(
    sources: Iterable[str], cache: dict[str, str], size_of: dict[str, int | None], sizes: set[int]
) -> dict[str, str]:
    """digest → one source with that digest (for the error message), for the sources whose size is in
    ``sizes`` (a file of another size cannot be equal to any on the other side)."""
    out: dict[str, str] = {}
    for s in sources:
        if size_of[s] not in sizes:
            continue
        try:
            out.setdefault(_digest(s, cache), s)
        except OSError:
            continue
    return out


def check_no_leaks(sources: dict[str, tuple[list[str] | None, list[str] | None]], show: int = 3) -> None:
    """``sources``: task → (train sources, validation sources). Raises ``DataError`` naming each pair
    (validation task, training task) that shares samples, with their count and a few examples."""
    cache: dict[str, str] = {}
    size_of = {s: _size(s) for t, v in sources.values() for s in (*(t or ()), *(v or ()))}  # one stat each
    sizes = {
        n: ({size_of[s] for s in t or ()}, {size_of[s] for s in v or ()}) for n, (t, v) in sources.items()
    }
    problems = []
    for val_task, (_, val) in sources.items():
        if val is None:
            continue
        for train_task, (train, _) in sources.items():
            if train_task == val_task or train is None:
                continue
            both = sizes[val_task][1] & sizes[train_task][0] - {None}
            if not both:
                continue
            held_out = _fingerprints(val, cache, size_of, both)
            seen = _fingerprints(train, cache, size_of, both)
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
