"""Text classification from JSONL manifests (DESIGN.md, Data): ``root/train.jsonl`` and ``root/val.jsonl``,
one ``{"text": "…", "label": "class name"}`` per line; ``root/classes.txt`` (one name per line) fixes
the class order, otherwise the sorted training labels do.

Texts are tokenized once (``bos`` + tokens + ``eos``, cut to ``max_len``); batches are padded to their
longest text: ``text`` (B, N) long, ``text_valid`` (B, N) bool (True = real token), ``label`` (B,) long.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .collate import pad_ids
from .datamodule import TaskData
from .jsonl import label_field, read_jsonl
from .leaks import text_source
from .roots import DataError, resolve_root
from .text import read_utf8


def read_manifest(path: Path) -> list[tuple[str, str]]:
    """``(text, label)`` pairs of a JSONL file. Raises ``DataError`` naming ``file:line`` for a line that
    is not UTF-8, or not a JSON object with a string ``text`` and a ``label`` (a string or a number)."""
    rows = []
    for n, row in read_jsonl(path, ("text", "label")):
        if not isinstance(row["text"], str):
            raise DataError(f"{path}:{n}: 'text' must be a string, got {type(row['text']).__name__}")
        rows.append((row["text"], label_field(path, n, row, "label")))
    return rows


class TokenizedTexts(Dataset):
    """Pre-tokenized texts with integer labels; items ``{"ids": list[int], "label": int}``."""

    def __init__(self, ids: list[list[int]], labels: list[int]):
        self.ids, self.labels = ids, labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"ids": self.ids[i], "label": self.labels[i]}


def collate_texts(samples: list[dict], pad_id: int) -> dict:
    """Right-pad to the longest text of the batch."""
    ids, valid = pad_ids([s["ids"] for s in samples], pad_id)
    return {"text": ids, "text_valid": valid, "label": torch.tensor([s["label"] for s in samples])}


def class_names(root: Path, train_rows: list[tuple[str, str]]) -> list[str]:
    path = root / "classes.txt"
    if path.is_file():
        classes = [c.strip() for c in read_utf8(path).splitlines() if c.strip()]
        dupes = sorted({c for c in classes if classes.count(c) > 1})
        if dupes:
            raise DataError(f"{path} lists {dupes[:5]} more than once")
        return classes
    return sorted({label for _, label in train_rows})


def text_classification_data(cfg, tokenizer, num_classes: int | None, seed: int):
    """``TaskData`` for a ``TextClassificationDataConfig``. Raises ``DataNotFoundError`` (a missing root)
    or ``DataError`` (missing manifests, malformed lines, labels outside the classes, a head of the
    wrong size)."""
    import functools

    root = resolve_root(cfg.root)
    for split in ("train", "val"):
        if not (root / f"{split}.jsonl").is_file():
            raise DataError(f'{root} has no {split}.jsonl (one {{"text": …, "label": …}} per line)')
    train_rows, val_rows = read_manifest(root / "train.jsonl"), read_manifest(root / "val.jsonl")
    if cfg.limit_train is not None:
        order = np.random.default_rng(seed).permutation(len(train_rows))[: cfg.limit_train]
        train_rows = [train_rows[i] for i in sorted(order)]
    classes = class_names(root, train_rows)
    if num_classes is not None and num_classes != len(classes):
        raise DataError(f"{root} has {len(classes)} classes but the head has num_classes={num_classes}")
    index = {c: i for i, c in enumerate(classes)}

    def make(rows, split):
        unknown = sorted({label for _, label in rows if label not in index})
        if unknown:
            raise DataError(f"{root / f'{split}.jsonl'}: labels {unknown[:5]} are not among the classes")
        ids = tokenizer.encode_batch([t for t, _ in rows], bos=True, eos=True)
        ids = [s[: cfg.max_len - 1] + [s[-1]] if len(s) > cfg.max_len else s for s in ids]  # keep eos
        return TokenizedTexts(ids, [index[label] for _, label in rows])

    return TaskData(
        train=make(train_rows, "train"),
        val=make(val_rows, "val"),
        train_sources=[text_source(t) for t, _ in train_rows],
        val_sources=[text_source(t) for t, _ in val_rows],
        collate=functools.partial(collate_texts, pad_id=tokenizer.pad_id),
        batch_size=cfg.batch_size,
        val_batch_size=cfg.val_batch_size or cfg.batch_size,
        num_workers=cfg.num_workers,
        drop_last=cfg.drop_last,
    )
