"""Text corpora as training sequences.

A corpus is a plain-text file, or a folder of ``.txt`` files, whose documents are separated by blank
lines (``mmformer data prepare kjv`` writes one). It is tokenized once into a
cached memory-mapped token file next to the corpus (keyed by the corpus and the tokenizer, so a
changed tokenizer never reads stale ids), then served either

  * packed — documents, each followed by ``eos``, concatenated and cut into fixed windows; every
    token carries its document id so attention never crosses documents (``text_document``), or
  * padded — one document per sample, truncated to the window and padded with ``pad``.

Samples use the fixed batch keys ``text`` (N,) long, ``text_valid`` (N,) bool (True = real token)
and ``text_document`` (N,) long. The train / validation split is by document, seeded.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..progress import progress
from .datamodule import TaskData
from .leaks import text_source
from .roots import DataError, resolve_root


def read_utf8(path: Path) -> str:
    """The text of ``path``; raises ``DataError`` naming the file, the byte offset and the line of the first
    byte that is not UTF-8."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}: not UTF-8 text at byte {e.start} (line {line}; byte 0x{data[e.start]:02x}: {e.reason})"
        ) from None


def read_documents(path: Path) -> list[str]:
    """Documents of a corpus: a ``.txt`` file, or every ``.txt`` file of a folder (sorted); inside each
    file, documents are separated by blank lines.

    Raises ``DataError`` when there is no text, or for a file that is not UTF-8 (naming the byte).
    """
    path = Path(path)
    files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    docs = [d for f in files for d in read_utf8(f).split("\n\n")]
    docs = [d.strip("\n") for d in docs if d.strip()]
    if not docs:
        raise DataError(f"no text found in {path}")
    return docs


def split_documents(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of ``n`` document indices into ``(train, val)``; at least one document each."""
    if n < 2:
        raise DataError(f"a train/validation split needs at least 2 documents, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    return np.sort(order[n_val:]), np.sort(order[:n_val])


CACHE_BATCH = 1024  # documents per encode_batch call of the token cache (one progress update each)


class TokenCache:
    """All documents tokenized once: ``tokens`` (memory-mapped uint32) and ``offsets`` (n_docs + 1,)
    so document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``.

    Stored as ``<cache_dir>/<key>.tokens`` / ``.offsets.npy`` with ``key`` = hash of the documents and
    the tokenizer's JSON; written atomically (temporary file + rename).
    """

    def __init__(self, documents: list[str], tokenizer, cache_dir: Path):
        digest = hashlib.sha256()
        for d in documents:
            digest.update(d.encode("utf-8"))
            digest.update(b"\0")
        digest.update(tokenizer.to_json().encode("utf-8"))
        key = digest.hexdigest()[:16]
        cache_dir = Path(cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
        self.tokens_path, self.offsets_path = cache_dir / f"{key}.tokens", cache_dir / f"{key}.offsets.npy"
        self.created = not (self.tokens_path.is_file() and self.offsets_path.is_file())
        if self.created:
            ids: list[list[int]] = []
            with progress(desc="token cache: tokenizing", total=len(documents), unit="doc") as bar:
                for a in range(0, len(documents), CACHE_BATCH):
                    ids += tokenizer.encode_batch(documents[a : a + CACHE_BATCH])
                    bar.update(len(documents[a : a + CACHE_BATCH]))
            offsets = np.zeros(len(ids) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([len(x) for x in ids])
            flat = np.fromiter((t for x in ids for t in x), dtype=np.uint32, count=int(offsets[-1]))
            tag = (
                f".{os.getpid()}.tmp"  # ranks may build the same cache at once: private files, atomic rename
            )
            tmp = self.tokens_path.with_name(self.tokens_path.name + tag)
            flat.tofile(tmp)
            os.replace(tmp, self.tokens_path)
            tmp_off = self.offsets_path.with_name(self.offsets_path.name + tag + ".npy")
            np.save(tmp_off, offsets)
            os.replace(tmp_off, self.offsets_path)
        self.offsets = np.load(self.offsets_path)
        self.tokens = np.memmap(self.tokens_path, dtype=np.uint32, mode="r", shape=(int(self.offsets[-1]),))

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


class PackedText(Dataset):
    """Documents ``doc_ids`` (in that order), each followed by ``eos``, packed into windows of
    ``seq_len`` tokens; the remainder that does not fill a window is dropped.

    ``text_document`` numbers the documents inside each window from 0 (a document cut by the window
    edge continues as document 0 of the next window).
    """

    def __init__(self, cache: TokenCache, doc_ids: np.ndarray, seq_len: int, eos_id: int):
        parts, docs = [], []
        for k, i in enumerate(doc_ids):
            toks = cache.document(int(i))
            parts += [np.asarray(toks, dtype=np.int64), np.array([eos_id])]
            docs.append(np.full(len(toks) + 1, k, dtype=np.int64))
        self.ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self.doc = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
        self.seq_len = seq_len
        if len(self.ids) < seq_len:
            raise DataError(f"{len(self.ids)} tokens cannot fill one window of seq_len={seq_len}")

    def __len__(self) -> int:
        return len(self.ids) // self.seq_len

    def __getitem__(self, i: int) -> dict:
        sl = slice(i * self.seq_len, (i + 1) * self.seq_len)
        doc = torch.from_numpy(self.doc[sl].copy())
        return {
            "text": torch.from_numpy(self.ids[sl].copy()),
            "text_valid": torch.ones(self.seq_len, dtype=torch.bool),
            "text_document": doc - doc[0],
        }


class PaddedText(Dataset):
    """One document per sample (``bos`` + tokens + ``eos``), truncated to ``seq_len`` and padded with
    ``pad`` (``text_valid`` False there)."""

    def __init__(
        self, cache: TokenCache, doc_ids: np.ndarray, seq_len: int, bos_id: int, eos_id: int, pad_id: int
    ):
        self.cache, self.doc_ids, self.seq_len = cache, np.asarray(doc_ids), seq_len
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

    def __len__(self) -> int:
        return len(self.doc_ids)

    def __getitem__(self, i: int) -> dict:
        toks = [self.bos_id, *self.cache.document(int(self.doc_ids[i])).tolist(), self.eos_id][: self.seq_len]
        ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        ids[: len(toks)] = torch.tensor(toks, dtype=torch.long)
        valid = torch.zeros(self.seq_len, dtype=torch.bool)
        valid[: len(toks)] = True
        return {
            "text": ids,
            "text_valid": valid,
            "text_document": torch.zeros(self.seq_len, dtype=torch.long),
        }


def collate_trimmed(samples: list[dict]) -> dict:
    """``default_collate`` of padded documents, cut after the batch's longest one (trailing columns
    that are padding in every row: they change no output, only cost compute)."""
    from torch.utils.data import default_collate

    batch = default_collate(samples)
    n = int(batch["text_valid"].sum(1).max())
    return {k: v[:, :n] if k.startswith("text") else v for k, v in batch.items()}


def corpus_split(root: Path, val_fraction: float, seed: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``(documents, train_ids, val_ids)`` of a corpus."""
    docs = read_documents(root)
    train, val = split_documents(len(docs), val_fraction, seed)
    return docs, train, val


def text_data(cfg, tokenizer, seed: int):
    """``TaskData`` for a ``TextDataConfig``: tokenize once (cached under ``<root>/.cache``), split by
    document, pack or pad. Raises ``DataNotFoundError`` / ``DataError`` for a missing or empty corpus."""
    from torch.utils.data import default_collate

    root = resolve_root(cfg.root)
    docs, train, val = corpus_split(root, cfg.val_fraction, seed)
    cache = TokenCache(docs, tokenizer, (root if root.is_dir() else root.parent) / ".cache")

    def make(ids):
        if cfg.pack:
            return PackedText(cache, ids, cfg.seq_len, tokenizer.eos_id)
        return PaddedText(cache, ids, cfg.seq_len, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)

    lengths = None
    if getattr(cfg, "bucket_by_length", False):

        def lengths() -> list[int]:  # bos + document + eos, as PaddedText cuts it
            return [min(len(cache.document(int(i))) + 2, cfg.seq_len) for i in train]

    return TaskData(
        train=make(train),
        val=make(val),
        train_sources=[text_source(docs[i]) for i in train],
        val_sources=[text_source(docs[i]) for i in val],
        collate=collate_trimmed if lengths is not None else default_collate,
        lengths=lengths,
        batch_size=cfg.batch_size,
        val_batch_size=cfg.val_batch_size or cfg.batch_size,
        num_workers=cfg.num_workers,
        drop_last=cfg.drop_last,
    )
