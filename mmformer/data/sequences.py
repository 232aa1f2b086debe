"""Sequences of integer tokens with a class label — ListOps expressions, Pathfinder and MNIST pixels,
KJV bytes (the Long Range Arena tasks, ``mmformer.data.lra``) — as ``data.kind: sequences`` reads them
from the on-disk format of ``mmformer.data.sequence_format``.

Batches: ``ids`` (B, L) long, right-padded with 0 to the longest sequence of the batch (0 is an
ordinary id; the mask tells padding apart); ``ids_valid`` (B, L) bool (True = real token); ``label``
(B,) long.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch.utils.data import Dataset

from .datamodule import TaskData
from .leaks import TEXT
from .roots import DataError, resolve_root
from .sequence_format import read_meta, read_split

# leak-check key prefix (``data.leaks``): compared as strings, like texts; equal token sequences are the same sample
SOURCE = TEXT + "sequence:"


class TokenSequences(Dataset):
    """Items ``{"ids": (n,) long, "label": int}`` of one split, each cut to ``max_len`` tokens."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, labels: np.ndarray, max_len: int):
        self.tokens, self.offsets, self.labels, self.max_len = tokens, offsets, labels, max_len

    def __len__(self) -> int:
        return len(self.labels)

    def length(self, i: int) -> int:
        return int(min(self.offsets[i + 1] - self.offsets[i], self.max_len))

    def __getitem__(self, i: int) -> dict:
        start = int(self.offsets[i])
        ids = self.tokens[start : start + self.length(i)].astype(np.int64)
        return {"ids": torch.from_numpy(ids), "label": int(self.labels[i])}

    def sources(self) -> list[str]:
        """One key per sample for the cross-task leak check: a digest of its (cut) tokens."""
        out = []
        for i in range(len(self)):
            start = int(self.offsets[i])
            ids = self.tokens[start : start + self.length(i)].astype(np.int64)
            out.append(SOURCE + hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest())
        return out


def collate_sequences(samples: list[dict]) -> dict:
    """Right-pad to the longest sequence of the batch (the pad id 0 is masked by ``ids_valid``)."""
    n = max((len(s["ids"]) for s in samples), default=0)
    ids = torch.zeros(len(samples), n, dtype=torch.long)
    valid = torch.zeros(len(samples), n, dtype=torch.bool)
    for i, s in enumerate(samples):
        ids[i, : len(s["ids"])] = s["ids"]
        valid[i, : len(s["ids"])] = True
    return {"ids": ids, "ids_valid": valid, "label": torch.tensor([s["label"] for s in samples])}


def sequences_data(
    cfg,
    vocab_size: int,
    max_positions: int | None,
    num_classes: int | None,
    seed: int,
    limit_reason: str = "",
):
    """``TaskData`` for a ``SequencesDataConfig`` read by an ``ids`` tokenizer of ``vocab_size`` ids, the
    model reading at most ``max_positions`` ids per sequence (None: no limit) because of
    ``limit_reason`` (the error's words: learned positions, a kernel's position biases).

    Raises ``DataNotFoundError`` (a missing root) or ``DataError``: no meta.json or split file, ids
    beyond the tokenizer's vocabulary, sequences longer than its positions, a head of the wrong size.
    """
    root = resolve_root(cfg.root)
    meta = read_meta(root)
    if meta["vocab_size"] > vocab_size:
        raise DataError(
            f"{root} has ids up to {meta['vocab_size'] - 1} but the ids tokenizer has vocab_size={vocab_size}"
        )
    max_len = cfg.max_len or meta["max_len"]
    if max_positions is not None and max_len > max_positions:
        why = limit_reason or f"the model reads at most {max_positions} ids"
        raise DataError(
            f"{root} has sequences of up to {max_len} tokens but {why}: raise it, or cut the sequences "
            "with data.max_len"
        )
    classes = meta["classes"]
    if num_classes is not None and num_classes != len(classes):
        raise DataError(f"{root} has {len(classes)} classes but the head has num_classes={num_classes}")
    train = TokenSequences(*read_split(root, cfg.train_split, meta), max_len)
    val = TokenSequences(*read_split(root, cfg.val_split, meta), max_len)
    if cfg.limit_train is not None and cfg.limit_train < len(train):
        keep = np.sort(np.random.default_rng(seed).permutation(len(train))[: cfg.limit_train])
        lengths = np.diff(train.offsets)[keep]
        chunks = [train.tokens[train.offsets[i] : train.offsets[i + 1]] for i in keep]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        train = TokenSequences(np.concatenate(chunks), offsets, train.labels[keep], max_len)
    lengths = None
    if cfg.bucket_by_length:

        def lengths() -> list[int]:
            return [train.length(i) for i in range(len(train))]

    return TaskData(
        train=train,
        val=val,
        train_sources=train.sources(),
        val_sources=val.sources(),
        collate=collate_sequences,
        batch_size=cfg.batch_size,
        val_batch_size=cfg.val_batch_size or cfg.batch_size,
        num_workers=cfg.num_workers,
        drop_last=cfg.drop_last,
        lengths=lengths,
    )
