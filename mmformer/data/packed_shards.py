"""Packed training windows from text shards (``data: {kind: shards, pack: true}``), as ``data.kind: text``
packs a corpus: documents, each tokenized and followed by ``eos``, concatenated and cut into windows of
``seq_len`` tokens; ``text_document`` numbers the documents inside each window from 0 (a document cut by
the window edge continues as document 0 of the next window), so attention never crosses documents.

Sizing an epoch (every rank must take the same number of steps, known before the epoch starts): the
number of tokens is known up front, per shard, for the recipe's tokenizer — written into ``index.json``
by ``mmformer data shard --modality text --tokenizer PATH``, or otherwise counted once from the shards and
cached as ``<root>/.cache/tokens-<tokenizer hash>-<split>.json``. The shards are split once into one
group per (rank, data-loader worker) with near-equal token totals (largest shard first, each into the
lightest group); every epoch deals the groups out in a new order, and each worker packs the documents of
its group (its shards shuffled, then a shuffling buffer, as ``ShardStream``) into ``Q`` batches of
windows, ``Q`` what the lightest group fills: every worker and rank delivers as many, and ``len()`` is
``Q · batch_size · workers``.

What an epoch leaves out: no token is read twice. With one rank and one worker, exactly the last
``T - len · seq_len < batch_size · seq_len`` tokens of the shuffled stream; otherwise also what each group
holds beyond the lightest (a warning above 5 % of the tokens: shards of more equal size waste less).
Packed text needs at least one shard per (rank, worker) — a ``DataError`` names the fix otherwise.

Validation is not packed: one padded document per sample (``bos`` + tokens + ``eos``, cut at
``seq_len``), every document exactly once over the ranks, so the window count needs no estimate. A run
resumed mid-epoch tokenizes, but does not yield, the windows its workers had already delivered.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ..progress import progress
from .roots import DataError
from .shards import FORMAT, INDEX, ShardStream, buffer_shuffled, read_samples, shard_location, write_shards
from .text import corpus_split

log = logging.getLogger("mmformer.data")


def tokenizer_digest(tokenizer) -> str:
    """A short hash of the tokenizer's JSON: token counts are valid for this tokenizer only."""
    return hashlib.sha256(tokenizer.to_json().encode("utf-8")).hexdigest()[:16]


def document_encoder(tokenizer) -> Callable[[dict], list[int]]:
    """Raw text sample → its token ids followed by ``eos`` (what ``PackedText`` packs per document)."""

    def encode(raw: dict) -> list[int]:
        text = raw["txt"].decode("utf-8") if isinstance(raw["txt"], bytes) else str(raw["txt"])
        return [*tokenizer.encode(text), tokenizer.eos_id]

    return encode


def count_tokens(root: Path, shards: list[list], tokenizer) -> list[int]:
    """Tokens (``eos`` included) of each shard's readable documents (a damaged shard's lost tail is named
    once and not counted: training skips it too)."""
    encode = document_encoder(tokenizer)

    def tokens(raw: dict) -> int:
        try:
            return len(encode(raw))
        except Exception:  # training skips it (and names it) too
            return 0

    return [
        sum(tokens(raw) for raw in read_samples(shard_location(root, name), n, lambda lost: None))
        for name, n in progress(shards, "counting tokens", unit="shard")
    ]


def token_counts(root: Path, info: dict, split: str, tokenizer) -> list[int]:
    """Per-shard token counts of ``split`` for ``tokenizer``: from ``index.json`` when it was written
    with this tokenizer, else from the cache, else counted (one pass over the split) and cached."""
    digest, shards = tokenizer_digest(tokenizer), info["splits"][split]
    stored = info.get("tokens", {})
    if stored.get("tokenizer") == digest and split in stored.get("splits", {}):
        return list(stored["splits"][split])
    cache = Path(root) / ".cache" / f"tokens-{digest}-{split}.json"
    if cache.is_file():
        cached = json.loads(cache.read_text())
        if cached.get("shards") == [name for name, _ in shards]:
            return cached["tokens"]
    log.info(
        "counting the tokens of %d %s shards once (to size packed epochs); `mmformer data shard "
        "--tokenizer PATH` stores them in index.json",
        len(shards),
        split,
    )
    counts = count_tokens(root, shards, tokenizer)
    try:  # a read-only shard folder: counted again next time
        cache.parent.mkdir(exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")  # ranks may count at once
        tmp.write_text(json.dumps({"shards": [name for name, _ in shards], "tokens": counts}))
        os.replace(tmp, cache)
    except OSError:
        pass
    return counts


class PackedShardStream(ShardStream):
    """Training windows ``{"text": (seq_len,) long, "text_valid": (seq_len,) bool (all True),
    "text_document": (seq_len,) long, "bad_samples": [shard:key, …]}`` packed from text shards.

    Args:
        root, shards: as ``ShardStream`` (the training split).
        tokens: tokens of each shard (``eos`` included), for the epoch length (``token_counts``).
        encode: raw sample → token ids + ``eos`` (``document_encoder``).
        seq_len: tokens per window; the rest as ``ShardStream``.

    Raises ``DataError`` when the shards cannot fill one batch of windows per rank.
    """

    def __init__(
        self,
        root: Path,
        shards: list[list],
        tokens: list[int],
        encode: Callable[[dict], list[int]],
        seq_len: int,
        batch_size: int,
        world: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle_buffer: int = 1000,
    ):
        if len(tokens) != len(shards):
            raise DataError(f"{root}: {len(tokens)} token counts for {len(shards)} shards")
        self.tokens, self.seq_len = tokens, seq_len
        super().__init__(root, shards, encode, True, batch_size, world, rank, seed, shuffle_buffer)

    def place(self, world: int, rank: int, workers: int = 0) -> None:
        """Read as rank ``rank`` of ``world`` with ``workers`` loader workers (0: the main process).

        The shards are split once into ``world · max(1, workers)`` groups of near-equal token totals
        (largest first, each to the lightest group); every epoch deals the groups to the (rank, worker)
        pairs in a new order, and each worker packs ``Q`` batches of windows from its group, ``Q`` what
        the lightest group fills — so every worker delivers as many, and no token is read twice.
        Raises ``DataError`` with fewer shards than groups or too few tokens for one batch each."""
        self.world, self.rank, self.workers = world, rank, max(1, workers)
        n_groups = world * self.workers
        if len(self.shards) < n_groups:
            raise DataError(
                f"{self.root}: {len(self.shards)} training shards for {world} rank(s) × {self.workers} "
                f"loader worker(s): packed text needs a shard per worker; reshard with a smaller "
                "--samples-per-shard, lower num_workers or use fewer processes"
            )
        groups: list[list[int]] = [[] for _ in range(n_groups)]
        totals = [0] * n_groups
        for s in sorted(range(len(self.shards)), key=lambda s: (-self.tokens[s], s)):
            g = min(range(n_groups), key=lambda g: (totals[g], g))
            groups[g].append(s)
            totals[g] += self.tokens[s]
        self.groups = groups
        self.quota = min(totals) // self.seq_len // self.batch_size  # batches per worker
        self.per_rank = self.quota * self.batch_size * self.workers
        if self.quota == 0:
            raise DataError(
                f"{self.root}: the lightest of {n_groups} shard groups holds {min(totals)} tokens, fewer "
                f"than one batch of windows ({self.batch_size} × seq_len={self.seq_len}); use fewer "
                "ranks / workers or a smaller batch"
            )
        uneven = sum(totals) - n_groups * min(totals)  # what the groups hold beyond the lightest
        if uneven > 0.05 * sum(totals):
            log.warning(
                "%s: %d of %d training tokens (%.0f %%) are left out of every epoch: the shard groups of "
                "%d ranks × %d workers hold %d to %d tokens and each worker packs what the lightest "
                "fills; shards of more equal size, or more of them, waste less",
                self.root, uneven, sum(totals), 100 * uneven / sum(totals), world, self.workers,
                min(totals), max(totals),
            )  # fmt: skip

    def _train(self, workers: int, worker: int, skip: int) -> Iterator[dict]:
        if workers != self.workers:
            raise DataError(
                f"{self.root}: placed for {self.workers} loader worker(s) but read by {workers}: "
                "call place(world, rank, num_workers) with the loader's num_workers"
            )
        deal = list(range(len(self.groups)))
        random.Random(hash((self.seed, self.epoch))).shuffle(deal)  # the same on every rank
        mine = list(self.groups[deal[self.rank * workers + worker]])
        rng = random.Random(hash((self.seed, self.epoch, self.rank, worker)))
        rng.shuffle(mine)
        quota = self.quota * self.batch_size
        own_skip = self._share(skip, workers, worker)  # a resumed epoch: this worker's already trained
        n = self.seq_len
        ids: list[int] = []
        doc: list[int] = []
        delivered, documents, bad = 0, 0, []
        lost: list[str] = []  # documents lost in damaged shards, listed with the next window
        while delivered < quota:  # one pass suffices unless documents turned out unreadable
            before = documents
            for pick in buffer_shuffled(self._pass(mine, lost.extend), self.shuffle_buffer, rng):
                toks = self._decoded(pick)
                if toks is None:
                    bad.append(f"{pick.get('__url__')}:{pick.get('__key__')}")
                    continue
                ids += toks
                doc += [documents] * len(toks)
                documents += 1
                at = 0
                while len(ids) - at >= n and delivered < quota:
                    if delivered >= own_skip:  # a resumed epoch: windows already trained are not yielded
                        d = torch.tensor(doc[at : at + n], dtype=torch.long)
                        yield {
                            "text": torch.tensor(ids[at : at + n], dtype=torch.long),
                            "text_valid": torch.ones(n, dtype=torch.bool),
                            "text_document": d - d[0],
                            "bad_samples": bad + lost,
                        }
                        bad = []
                        lost.clear()
                    delivered, at = delivered + 1, at + n
                if delivered >= quota:
                    return
                del ids[:at], doc[:at]
            if documents == before:
                raise DataError(
                    f"{self.root}: no readable document in shards {[self.shards[s][0] for s in mine]}"
                )
            log.warning(
                "%s: unreadable documents left worker %d short: reading its shards again", self.root, worker
            )
            rng.shuffle(mine)


def packed_text_stream(
    root: Path, info: dict, split: str, tokenizer, seq_len: int, batch_size: int, **common
):
    """The training ``PackedShardStream`` of ``split`` (``common``: seed, shuffle_buffer)."""
    return PackedShardStream(
        root,
        info["splits"][split],
        token_counts(root, info, split, tokenizer),
        document_encoder(tokenizer),
        seq_len,
        batch_size,
        **common,
    )


def collate_text(samples: list[dict]) -> dict:
    """``default_collate`` of text items (padded documents or packed windows), their ``bad_samples``
    lists joined into one (default_collate cannot stack lists of different lengths)."""
    from torch.utils.data import default_collate

    bad = [p for s in samples for p in s.get("bad_samples", [])]
    batch = default_collate([{k: v for k, v in s.items() if k != "bad_samples"} for s in samples])
    return {**batch, "bad_samples": bad}


def shard_text(
    src: Path, out: Path, val_fraction: float, seed: int, samples_per_shard: int = 1000, tokenizer=None
) -> dict:
    """Shard a text corpus (blank-line separated documents), one document per sample, split into train
    / val by document exactly as ``data.kind: text`` splits it (``val_fraction``, ``seed``). With a
    ``tokenizer`` (a ``TextTokenizer``) the index also holds each shard's token count under ``tokens``,
    which sizes packed epochs (``data.pack: true``) without a counting pass at training time."""
    docs, train, val = corpus_split(Path(src), val_fraction, seed)
    info = {"format": FORMAT, "modality": "text", "classes": [], "splits": {}}
    for split, ids in (("train", train), ("val", val)):
        samples = ({"txt": docs[int(i)]} for i in ids)
        info["splits"][split] = write_shards(samples, out, split, samples_per_shard, len(ids))
    if tokenizer is not None:
        info["tokens"] = {
            "tokenizer": tokenizer_digest(tokenizer),
            "splits": {split: count_tokens(out, sh, tokenizer) for split, sh in info["splits"].items()},
        }
    (out / INDEX).write_text(json.dumps(info, indent=1))
    return info
