"""The on-disk format of integer token sequences with class labels (``data.kind: sequences``,
``mmformer.data.sequences``; the Long Range Arena sets of ``mmformer.data.lra`` are written in it). Only
numpy: preparing data imports neither torch nor Lightning.

Under ``root``::

    meta.json      {"vocab_size": V, "max_len": N, "classes": [name, …], "splits": {split: count},
                    "vocabulary": [token text, …] (optional: what each id stands for),
                    "separator": S (optional: pairs stored as ``A, S, B``, read as two sequences by
                    ``data.pairs: true``; S is counted in V, and N is then the joined length)}
    <split>.npz    tokens  (T,) uint8 | uint16  every sequence of the split, concatenated
                   offsets (n + 1,) int64        sequence i is tokens[offsets[i]:offsets[i + 1]]
                   labels  (n,) int64            indices into meta's classes

Ids are in ``[0, V)``; 0 is an ordinary token (a digit, a black pixel, a NUL byte), not padding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .roots import DataError


def write_split(out: Path, split: str, seqs: Sequence[Sequence[int]], labels: Sequence[int]) -> None:
    """``out/<split>.npz`` of ``seqs`` (sequences of ids in 0–65,535; a 2-D array for equal lengths) and
    their class indices."""
    if len(seqs) != len(labels):
        raise ValueError(f"{len(seqs)} sequences but {len(labels)} labels")
    if isinstance(seqs, np.ndarray) and seqs.ndim == 2:
        lengths, flat = np.full(len(seqs), seqs.shape[1], dtype=np.int64), seqs.reshape(-1)
    else:
        arrays = [np.asarray(s) for s in seqs]
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= 2**16):
        raise ValueError("ids must be in [0, 65536)")
    dtype = np.uint8 if flat.size == 0 or flat.max() < 256 else np.uint16
    np.savez_compressed(
        out / f"{split}.npz",
        tokens=flat.astype(dtype),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        labels=np.asarray(labels, dtype=np.int64),
    )


def write_meta(
    out: Path, vocab_size: int, max_len: int, classes: Sequence[str], splits: dict, **extra
) -> None:
    meta = {"vocab_size": vocab_size, "max_len": max_len, "classes": list(classes), "splits": splits, **extra}
    (out / "meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def read_meta(root: Path) -> dict:
    """``root/meta.json``. Raises ``DataError`` when it is missing or lacks a key."""
    path = root / "meta.json"
    if not path.is_file():
        raise DataError(f"{root} has no meta.json (data.kind: sequences; see mmformer/data/sequences.py)")
    meta = json.loads(path.read_text(encoding="utf-8"))
    for key in ("vocab_size", "max_len", "classes"):
        if key not in meta:
            raise DataError(f"{path} has no {key!r}")
    return meta


def read_split(root: Path, split: str, meta: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, offsets, labels)`` of ``root/<split>.npz``, checked against ``meta``. Raises
    ``DataError`` naming the file: missing, an array missing, offsets that do not cut ``tokens``, ids
    outside the vocabulary, labels outside the classes."""
    path = root / f"{split}.npz"
    if not path.is_file():
        raise DataError(
            f"{root} has no {split}.npz (tokens, offsets, labels); splits there: "
            f"{', '.join(sorted(p.stem for p in root.glob('*.npz'))) or 'none'}"
        )
    with np.load(path) as z:
        missing = [k for k in ("tokens", "offsets", "labels") if k not in z.files]
        if missing:
            raise DataError(f"{path} lacks {', '.join(missing)}")
        tokens, offsets, labels = z["tokens"], z["offsets"].astype(np.int64), z["labels"].astype(np.int64)
    if (
        len(offsets) != len(labels) + 1
        or (len(offsets) and (offsets[0] != 0 or offsets[-1] != len(tokens)))
        or np.any(np.diff(offsets) < 0)
    ):
        raise DataError(f"{path}: offsets must rise from 0 to len(tokens) with one more entry than labels")
    if tokens.size and int(tokens.max()) >= meta["vocab_size"]:
        raise DataError(
            f"{path}: id {int(tokens.max())} is outside the vocabulary (vocab_size={meta['vocab_size']})"
        )
    if labels.size and (labels.min() < 0 or labels.max() >= len(meta["classes"])):
        raise DataError(f"{path}: labels must be in [0, {len(meta['classes'])}) (meta.json's classes)")
    return tokens, offsets, labels
