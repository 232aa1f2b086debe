"""Sequences of integer tokens with a class label — ListOps expressions, Pathfinder and MNIST pixels,
KJV bytes (the Long Range Arena tasks, ``mmformer.data.lra``) — as ``data.kind: sequences`` reads them
from the on-disk format of ``mmformer.data.sequence_format``.

Batches: ``ids`` (B, L) long, right-padded with 0 to the longest sequence of the batch (0 is an
ordinary id; the mask tells padding apart); ``ids_valid`` (B, L) bool (True = real token); ``label``
(B,) long. With ``data.pairs: true`` each stored sequence is two joined by meta.json's ``separator`` id
(``kjv-pairs``) and a batch of B pairs holds ``2B`` rows: the B first sequences, then the B second ones
in the same order (``collate_pairs``; read by a two-tower head, ``mmformer.models.PairClassifierHead``).
"""

from __future__ import annotations

import hashlib
from functools import partial

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


class TokenPairs(Dataset):
    """Items ``{"ids": (n_a,) long, "ids_b": (n_b,) long, "label": int}``: each sequence of ``joined``
    split at its one ``separator`` id (which neither half keeps), each half cut to ``max_len`` tokens.

    Raises ``DataError`` naming ``where`` (the split file) and the first sequence that holds the
    separator not exactly once, or whose first or second half is empty (a pooled blank).
    """

    def __init__(self, joined: TokenSequences, separator: int, max_len: int | None, where: str):
        self.joined, self.max_len = joined, max_len
        offsets = joined.offsets
        at = np.flatnonzero(joined.tokens == separator)  # every separator's position
        owner = np.searchsorted(offsets, at, side="right") - 1  # the sequence each lies in
        count = np.bincount(owner, minlength=len(joined))
        if len(joined) and (bad := np.flatnonzero(count != 1)).size:
            raise DataError(
                f"{where}: sequence {int(bad[0])} holds the separator id {separator} {int(count[bad[0]])} "
                "times; data.pairs reads sequences that are two joined by exactly one separator"
            )
        self.separators = at  # sequence i's separator is at[i] (positions rise with the sequences)
        first, second = at - offsets[:-1], offsets[1:] - at - 1
        if (empty := np.flatnonzero((first == 0) | (second == 0))).size:
            i = int(empty[0])
            raise DataError(
                f"{where}: sequence {i} has an empty {'first' if first[i] == 0 else 'second'} half (the "
                f"separator id {separator} at its {'start' if first[i] == 0 else 'end'}); a pair needs two "
                "sequences"
            )
        cut = max_len or np.iinfo(np.int64).max
        self.first, self.second = np.minimum(first, cut), np.minimum(second, cut)

    def __len__(self) -> int:
        return len(self.joined)

    def length(self, i: int) -> int:
        """The padded length this pair's rows take: its longer half."""
        return int(max(self.first[i], self.second[i]))

    def longest(self) -> int:
        return int(max(self.first.max(initial=0), self.second.max(initial=0)))

    def __getitem__(self, i: int) -> dict:
        start, sep, tokens = int(self.joined.offsets[i]), int(self.separators[i]), self.joined.tokens
        a = tokens[start : start + int(self.first[i])].astype(np.int64)
        b = tokens[sep + 1 : sep + 1 + int(self.second[i])].astype(np.int64)
        return {"ids": torch.from_numpy(a), "ids_b": torch.from_numpy(b), "label": int(self.joined.labels[i])}

    def sources(self) -> list[str]:
        """One key per pair for the cross-task leak check: a digest of its two (cut) halves, as the model
        reads them."""
        out = []
        for i in range(len(self)):
            item = self[i]
            ids = np.concatenate([item["ids"].numpy(), [-1], item["ids_b"].numpy()])
            out.append(SOURCE + hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest())
        return out


def collate_pairs(samples: list[dict]) -> dict:
    """B pairs → ``ids`` / ``ids_valid`` (2B, L): the first sequences, then the second ones, right-padded
    to the longest of all 2B; ``label`` (B,)."""
    rows = collate_sequences(
        [{"ids": s["ids"], "label": 0} for s in samples] + [{"ids": s["ids_b"], "label": 0} for s in samples]
    )
    return {**rows, "label": torch.tensor([s["label"] for s in samples])}


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
    classes = meta["classes"]
    if num_classes is not None and num_classes != len(classes):
        raise DataError(f"{root} has {len(classes)} classes but the head has num_classes={num_classes}")
    if cfg.pairs and "separator" not in meta:
        raise DataError(
            f"{root / 'meta.json'} names no 'separator' id: data.pairs reads sequences that are two joined "
            "by one (as mmformer data prepare kjv-pairs writes them)"
        )
    if cfg.pairs and not 0 <= meta["separator"] < meta["vocab_size"]:
        raise DataError(
            f"{root / 'meta.json'}: the separator id {meta['separator']} is outside the vocabulary (ids 0-"
            f"{meta['vocab_size'] - 1}); vocab_size counts the separator"
        )
    # pairs: each half is cut to data.max_len, not the joined sequence
    max_len = meta["max_len"] if cfg.pairs else (cfg.max_len or meta["max_len"])
    train = TokenSequences(*read_split(root, cfg.train_split, meta), max_len)
    val = TokenSequences(*read_split(root, cfg.val_split, meta), max_len)
    if cfg.pairs:  # every stored pair checked, an error naming its index in the file (before limit_train)
        split_pairs = partial(TokenPairs, separator=meta["separator"], max_len=cfg.max_len)
        val = split_pairs(val, where=str(root / f"{cfg.val_split}.npz"))
        train_pairs = split_pairs(train, where=str(root / f"{cfg.train_split}.npz"))
    limited = cfg.limit_train is not None and cfg.limit_train < len(train)
    if limited:
        keep = np.sort(np.random.default_rng(seed).permutation(len(train))[: cfg.limit_train])
        lengths = np.diff(train.offsets)[keep]
        chunks = [train.tokens[train.offsets[i] : train.offsets[i + 1]] for i in keep]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        train = TokenSequences(np.concatenate(chunks), offsets, train.labels[keep], max_len)
    what = "sequences of"
    if cfg.pairs:
        train = split_pairs(train, where=f"{cfg.train_split}.npz, limited") if limited else train_pairs
        max_len, what = max(train.longest(), val.longest()), "pairs whose halves have"
    if max_positions is not None and max_len > max_positions:
        why = limit_reason or f"the model reads at most {max_positions} ids"
        raise DataError(
            f"{root} has {what} up to {max_len} tokens but {why}: raise it, or cut the sequences "
            "with data.max_len"
        )
    lengths = None
    if cfg.bucket_by_length:

        def lengths() -> list[int]:
            return [train.length(i) for i in range(len(train))]

    return TaskData(
        train=train,
        val=val,
        train_sources=train.sources(),
        val_sources=val.sources(),
        collate=collate_pairs if cfg.pairs else collate_sequences,
        batch_size=cfg.batch_size,
        val_batch_size=cfg.val_batch_size or cfg.batch_size,
        num_workers=cfg.num_workers,
        drop_last=cfg.drop_last,
        lengths=lengths,
    )
