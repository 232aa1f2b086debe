"""WebDataset tar shards, for corpora too big for one machine's folders (``mmformer data shard``).

A shard folder holds ``<split>-000000.tar`` … (WebDataset's format: the files of one sample share a key,
``000123.png`` + ``000123.cls``; written and read with the ``webdataset`` library) and ``index.json``
(the format, the modality, class names, each shard's sample count and, for text sharded with
``--tokenizer``, each shard's token count). Sample files by modality:

- ``image``: the original image bytes (``.png``, ``.jpg``, …) and ``.cls`` (class index);
- ``audio``: the original audio bytes (``.wav``, ``.flac``, …) and ``.cls``;
- ``text``: ``.txt``, one document (packed into ``seq_len`` windows with ``data.pack: true``:
  ``packed_shards``);
- ``image_caption`` / ``audio_caption``: the media bytes, ``.txt`` (the caption) and ``.cid`` (its
  caption id), for the contrastive, prefix-LM and encoder–decoder tasks (``caption_shards``).

``ShardStream`` reads them as an ``IterableDataset``; a shard is a path or a URL read through
``webdataset.gopen`` (``pipe:``, ``file:``, ``http(s):``, ``open_shard``). Shards without ``index.json``,
brace patterns, URLs and mixes of several sources are resolved by ``shard_sources`` (which also builds
the ``TaskData`` of ``data.kind: shards``). Training: every epoch the shard order is shuffled
from ``(seed, epoch)`` and dealt out by rank, then by data-loader worker (WebDataset's ``split_by_node``
/ ``split_by_worker``); samples pass through a shuffling buffer; each worker yields a fixed quota
(cycling its shards if they run short), so every rank takes the same number of steps and an epoch is
``samples // (world · batch_size)`` batches. Every sample is read exactly once per epoch when the shards
hold equal counts and their number divides by ranks × workers (otherwise a warning says so).
Evaluation: rank ``r`` keeps the samples whose global index is ``r`` mod ``world`` (every sample
exactly once over the ranks, as ``EvalShardSampler``).

Bad data follows the folder rule (``bad_samples``). ``index.json`` is checked when it is read: a shard
name that is not a plain file name inside the folder (``../x.tar``, ``/abs/x.tar``) or a shard that is
missing is refused, naming the entry. An unreadable sample is named once (``shard:key``) and skipped;
a shard cut short or damaged is named once with the number of samples lost after the damage, which
training skips (its quota is filled from its other shards) and evaluation counts as skipped: each lost or
unreadable evaluation sample is a ``stand_in`` row, dropped by the evaluation collate, so every rank
still runs the batches ``eval_batches`` counts. A run resumed mid-epoch skips, without decoding,
the samples its workers had already delivered, and does not even open the shard visits it had finished
(worked out from the counts: a pipe cannot seek). A training sample is decoded and augmented inside its own
random stream, seeded from ``(seed, epoch, shard name / key)`` (``seeding``), so its augmentation does
not depend on the worker that reads it or on a resume.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import random
import re
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..progress import progress
from .audio import folder_samples, load_complete
from .bad_samples import report_unreadable, stand_in, warn_once
from .folders import audio_extensions, class_files, find_classes, image_extensions
from .roots import DataError
from .seeding import sample_seed, seeded

log = logging.getLogger("mmformer.data")

FORMAT = "mmformer-webdataset/1"
INDEX = "index.json"


# --------------------------------------------------------------------------- writing
def write_shards(
    samples: Iterator[dict], out: Path, split: str, samples_per_shard: int, total: int | None = None
) -> list[list]:
    """Write ``samples`` (WebDataset dicts without ``__key__``; ``total`` of them, when known, for the
    progress bar) to ``out/<split>-NNNNNN.tar``; returns ``[[file name, number of samples], …]``."""
    import webdataset as wds

    out.mkdir(parents=True, exist_ok=True)
    shards: list[list] = []
    writer, count = None, 0
    for i, sample in enumerate(progress(samples, f"sharding {split}", total, unit="sample")):
        if writer is None or count == samples_per_shard:
            if writer is not None:
                writer.close()
                shards[-1][1] = count
            name = f"{split}-{len(shards):06d}.tar"
            writer, count = wds.TarWriter(str(out / name)), 0
            shards.append([name, 0])
        writer.write({"__key__": f"{i:09d}", **sample})
        count += 1
    if writer is not None:
        writer.close()
        shards[-1][1] = count
    return shards


def _file_samples(items: list[tuple[str, int]]) -> Iterator[dict]:
    for path, label in items:
        yield {Path(path).suffix.lower().lstrip("."): Path(path).read_bytes(), "cls": label}


def shard_folder(src: Path, out: Path, modality: str, samples_per_shard: int = 1000) -> dict:
    """Shard an image or audio class folder (``src/<split>/<class>/<file>``; every split found: ``train``,
    ``val``, …). Returns the index written to ``out/index.json``."""

    splits = sorted(p.name for p in Path(src).iterdir() if p.is_dir() and not p.name.startswith("."))
    if "train" not in splits:
        raise DataError(f"{src} has no train/ split folder")
    if modality == "image":
        classes = find_classes(Path(src) / "train")

        def items(split: str) -> list[tuple[str, int]]:
            return class_files(Path(src) / split, classes, image_extensions(), "image")[0]
    else:
        _, classes = folder_samples(Path(src) / "train")

        def items(split: str) -> list[tuple[str, int]]:
            return folder_samples(Path(src) / split, classes)[0]

    info = {"format": FORMAT, "modality": modality, "classes": classes, "splits": {}}
    for split in splits:
        files = items(split)
        info["splits"][split] = write_shards(_file_samples(files), out, split, samples_per_shard, len(files))
    (out / INDEX).write_text(json.dumps(info, indent=1))
    return info


def read_index(root: Path) -> dict:
    """``root/index.json``. Raises ``DataError`` naming it when it is missing, not an mmformer shard index,
    or lists a shard that is not a file name inside ``root`` or is missing from it."""
    path = Path(root) / INDEX
    if not path.is_file():
        raise DataError(f"{root} has no {INDEX}: write shards with `mmformer data shard`")
    try:
        info = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a JSON shard index ({e})") from None
    found = info.get("format") if isinstance(info, dict) else None
    if found != FORMAT:
        raise DataError(f"{path}: format {found!r}, expected {FORMAT!r}")
    if not isinstance(info.get("splits"), dict):
        raise DataError(f"{path}: 'splits' must map each split to its [[shard file name, samples], …]")
    for split, shards in info["splits"].items():
        for i, entry in enumerate(shards if isinstance(shards, list) else [shards]):
            where = f"{path}: splits.{split}[{i}]"
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
                raise DataError(f"{where}: expected [shard file name, samples], got {json.dumps(entry)[:80]}")
            name, n = entry
            if not _inside(name):
                raise DataError(f"{where}: shard {name!r} is not a file name inside {root}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise DataError(f"{where}: the sample count of {name!r} must be an integer >= 0, got {n!r}")
            if not (Path(root) / name).is_file():
                raise DataError(f"{where}: shard {name!r} is missing from {root}")
    return info


def _inside(name: str) -> bool:
    """A relative path that stays inside the shard folder: not empty, no root or drive, no ``..``."""
    parts = PurePosixPath(name.replace("\\", "/")).parts
    return bool(parts) and not parts[0].startswith("/") and ".." not in parts and ":" not in name


# --------------------------------------------------------------------------- reading
# what tarfile raises for a shard cut short or damaged (webdataset appends " @ <file>" to the message)
SHARD_ERRORS = (tarfile.TarError, EOFError, OSError)


def is_url(name: str | Path) -> bool:
    """A shard location with a scheme (``pipe:``, ``file:``, ``http(s):``, …): opened with webdataset's
    ``gopen`` (a single letter before ``:`` is a drive, not a scheme)."""
    return isinstance(name, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", name) is not None


def shard_location(root: Path, name: str) -> Path | str:
    """Where shard ``name`` of an index at ``root`` is: a URL as it is, else a path (an absolute ``name``
    stays itself, a relative one is inside ``root``)."""
    return name if is_url(name) else Path(root) / name


def open_shard(location: Path | str):
    """A binary stream of one shard: a local path with ``open``, a URL with ``webdataset.gopen``
    (``pipe:CMD`` reads CMD's output, ``file:``, ``http(s):`` through curl, …). Raises ``OSError``."""
    if not is_url(location):
        return open(location, "rb")
    from webdataset import gopen

    return gopen(str(location), "rb")


def read_samples(
    path: Path | str, expected: int | None = None, damaged: Callable[[list[str]], None] | None = None
) -> Iterator[dict]:
    """The samples of one tar shard (a path or a URL, ``open_shard``) as ``{"__key__": …, ext: bytes}``
    (webdataset's tar iterators).

    A shard that is damaged or cut short — a ``tarfile`` error, or fewer than its ``expected`` samples —
    yields the samples before the damage, then raises ``DataError`` naming it; with ``damaged`` it is
    named once in a warning instead, with the number of samples lost, and ``damaged`` receives them
    (``["<shard>#<k>", …]``, ``k`` the position in the shard), so the caller can count them and go on."""
    from webdataset.tariterators import group_by_keys, tar_file_iterator

    failure: list[BaseException] = []

    def members(f) -> Iterator[dict]:
        try:
            for member in tar_file_iterator(f):
                yield {**member, "__url__": str(path)}
        except SHARD_ERRORS as e:  # ends the member stream: the last complete sample is still grouped
            failure.append(e)

    count = 0
    try:
        stream = open_shard(path)
    except OSError as e:  # a shard that cannot be opened at all: every sample of it is lost
        failure.append(e)
    else:
        with stream as f:
            for sample in group_by_keys(members(f)):
                count += 1
                yield sample
    short = expected is not None and count < expected
    if not failure and not short:
        return
    total = f"of its {expected} samples" if expected is not None else "samples"
    if failure:
        e = failure[0]
        what = f"{type(e).__name__} after {count} {total} ({str(e).split(' @ ')[0]})"
    else:
        what = f"it ends after {count} {total}"
    if damaged is None:
        raise DataError(f"{path}: damaged shard: {what}")
    lost = [f"{path}#{k}" for k in range(count, expected if short else count)]
    warn_once(
        lost[0] if lost else str(path),
        "damaged shard %s: %s: its last %d samples are skipped",
        path, what, len(lost),
    )  # fmt: skip
    damaged(lost)


class ShardStream(IterableDataset):
    """Samples of one split's shards, decoded by ``decode(raw) -> item``.

    Args:
        root: the shard folder; ``shards``: ``[[file name, samples], …]`` of the split.
        decode: raw WebDataset sample → dataset item (raises on an unreadable one: it is skipped,
            named once with its shard and key and listed under ``bad_samples``).
        train: shuffle and deal shards by rank and worker (else: every sample once over the ranks).
        batch_size: the loader's batch size (quotas are whole batches); ``world``, ``rank``: processes.
        seed, shuffle_buffer: shard order and sample shuffling (``shuffle_buffer`` samples held).
    """

    def __init__(
        self,
        root: Path,
        shards: list[list],
        decode: Callable[[dict], dict],
        train: bool,
        batch_size: int,
        world: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle_buffer: int = 1000,
    ):
        if not shards or sum(n for _, n in shards) == 0:
            raise DataError(f"{root}: the split has no samples")
        self.root, self.shards, self.decode, self.train = Path(root), shards, decode, train
        self.batch_size, self.seed = batch_size, seed
        self.shuffle_buffer, self.epoch, self._skip = shuffle_buffer, 0, 0
        self.place(world, rank)

    def place(self, world: int, rank: int, workers: int = 0) -> None:
        """Read as rank ``rank`` of ``world`` (the datamodule calls this when it builds the loader; each
        worker of ``workers`` finds its part itself)."""
        self.world, self.rank = world, rank
        total = self.epoch_samples()
        self.per_rank = (
            (total // (world * self.batch_size)) * self.batch_size
            if self.train
            else len(range(rank, total, world))
        )
        sizes = {n for _, n in self.shards}
        if self.train and (len(self.shards) % world or len(sizes) > 1):
            log.warning(
                "%s: %d training shards of %s samples for %d ranks: ranks hold different numbers of "
                "samples, so within an epoch some are read twice and some not at all (equal steps on "
                "every rank come first); write shards whose count divides by ranks × workers",
                self.root,
                len(self.shards),
                "/".join(str(n) for n in sorted(sizes)),
                world,
            )

    def __len__(self) -> int:
        return self.per_rank

    def epoch_samples(self) -> int:
        """Samples in one training epoch over all ranks (before cutting to whole batches per rank)."""
        return sum(n for _, n in self.shards)

    def epoch_order(self) -> list[int]:
        """This epoch's shard visits (indices into ``shards``, a shard may come more than once, as in a
        mix with upsampling), in the order dealt out to ranks and workers: a seeded shuffle of
        ``(seed, epoch)``, the same on every rank."""
        order = list(range(len(self.shards)))
        random.Random(hash((self.seed, self.epoch))).shuffle(order)
        return order

    def eval_batches(self, rank: int, workers: int) -> int:
        """Evaluation batches rank ``rank`` reads with ``workers`` loader workers (each worker batches its
        own shards' samples; ``max(1, workers)``)."""
        workers, start, counts = max(1, workers), 0, [0] * max(1, workers)
        for s, (_, n) in enumerate(self.shards):
            counts[s % workers] += len(range((rank - start) % self.world, n, self.world))
            start += n
        return sum(-(-c // self.batch_size) for c in counts)

    def __getitem__(self, i: int) -> dict:
        """Sample ``i`` of the split in file order (the same on every rank), decoded: for the few items
        media callback shows (a causal LM's text-sample prompts). Reads its shard from the start. Raises
        ``IndexError`` past the end, ``DataError`` when its shard is damaged before it."""
        start = 0
        for name, n in self.shards:
            if 0 <= i - start < n:
                raw = next(itertools.islice(read_samples(self.location(name), n), i - start, None))
                return {"bad_samples": [], **self.decode(raw)}
            start += n
        raise IndexError(f"sample {i} of a split of {start}")

    def location(self, name: str) -> Path | str:
        """Where shard ``name`` is read from (``shard_location``)."""
        return shard_location(self.root, name)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, n: int) -> None:
        """Leave out the first ``n`` samples this rank would deliver next pass (a run resumed mid-epoch)."""
        self._skip = n

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        skip, self._skip = self._skip, 0
        if self.train:  # the loader starts a new pass at worker 0, but the interrupted epoch's next batch
            # came from worker ``done % workers``: each worker takes the part of the one in that seat
            worker = (worker + skip // self.batch_size) % workers
        yield from (self._train if self.train else self._eval)(workers, worker, skip)

    def _decoded(self, raw: dict) -> dict | None:
        try:
            return self.decode(raw)
        except Exception as e:  # a corrupt file in a shard: skipped and named (once)
            report_unreadable("sample", _where(raw), e)
            return None

    def _share(self, items: int, workers: int, worker: int) -> int:
        """Of a rank's first ``items`` items (whole batches, which the loader takes from its workers in
        turn), how many are worker ``worker``'s."""
        batches = items // self.batch_size
        return (batches // workers + (1 if worker < batches % workers else 0)) * self.batch_size

    def _deal(self, workers: int, worker: int, skip: int) -> tuple[list[int], int, int, random.Random]:
        """This epoch's ``(shards of this worker, its quota, items of it to skip, its generator)``."""
        order = self.epoch_order()
        mine = [s for i, s in enumerate(order) if i % self.world == self.rank] or [
            order[self.rank % len(order)]
        ]
        mine = [s for i, s in enumerate(mine) if i % workers == worker] or [mine[worker % len(mine)]]
        rng = random.Random(hash((self.seed, self.epoch, self.rank, worker)))
        return mine, self._share(self.per_rank, workers, worker), self._share(skip, workers, worker), rng

    def _train(self, workers: int, worker: int, skip: int) -> Iterator[dict]:
        mine, quota, own_skip, rng = self._deal(workers, worker, skip)
        unopened = self._finished_visits(list(mine), own_skip, workers, worker)
        delivered, bad = 0, []
        lost: list[str] = []  # samples lost in damaged shards, listed with the next item

        def visit(v: int, s: int, repeat: int) -> Iterator[dict]:
            name, n = self.shards[s]
            if v in unopened:  # all of it was trained before the interruption: stand-ins, not read
                yield from ({"__key__": str(j), "__url__": name} for j in range(n))
                return
            for raw in read_samples(self.location(name), n, lost.extend):
                yield {**raw, "__repeat__": repeat}

        for pick in self._picks(mine, rng, visit):
            if delivered >= quota:
                return
            if delivered < own_skip:  # a resumed epoch: what was already trained, not decoded
                delivered += 1
                continue
            key = f"{Path(str(pick['__url__'])).name}/{pick['__key__']}"
            if pick.get("__repeat__"):  # a shard read again in one epoch (a mix's upsampling, cycling)
                key += f"#{pick['__repeat__']}"
            with seeded(sample_seed(self.seed, self.epoch, key)):
                item = self._decoded(pick)
            if item is None:
                bad.append(_where(pick))
                continue
            item["bad_samples"], bad = bad + lost, []
            lost.clear()
            delivered += 1
            yield item
            if delivered >= quota:  # not a pick more: it could open the next shard
                return

    def _picks(
        self, mine: list[int], rng: random.Random, visit: Callable[[int, int, int], Iterator[dict]]
    ) -> Iterator[dict]:
        """This worker's samples in the order it takes them: passes over its shard visits ``mine`` (a
        worker that runs short starts another, in a new order) through the shuffling buffer.
        ``visit(v, s, repeat)``: the samples of this worker's ``v``-th shard visit, of shard ``s``, read
        ``repeat`` times before in this epoch."""
        counts: dict[int, int] = {}

        def visits(first: int) -> Iterator[dict]:
            for v, s in enumerate(list(mine), first):
                counts[s] = counts.get(s, 0) + 1
                yield from visit(v, s, counts[s] - 1)

        passes = 0
        while True:
            yield from buffer_shuffled(visits(passes * len(mine)), self.shuffle_buffer, rng)
            passes += 1
            rng.shuffle(mine)

    def _finished_visits(self, mine: list[int], skip: int, workers: int, worker: int) -> set[int]:
        """The shard visits all of whose samples are among the first ``skip`` that a resumed epoch leaves
        out, found by running the same shuffle over stand-ins sized by the shards' counts (nothing read):
        a resume opens no shard it has finished, so the position it restarts from is (shard visit,
        sample offset), not bytes read again — a pipe or URL cannot seek. Exact while every shard holds
        its counted samples."""
        if skip == 0:
            return set()
        rng = random.Random(hash((self.seed, self.epoch, self.rank, worker)))  # as _deal's

        def stand_ins(v: int, s: int, repeat: int) -> Iterator[dict]:
            return ({"v": v, "n": self.shards[s][1]} for _ in range(self.shards[s][1]))

        taken: dict[int, list[int]] = {}
        for pick in itertools.islice(self._picks(mine, rng, stand_ins), skip):
            taken.setdefault(pick["v"], [0, pick["n"]])[0] += 1
        return {v for v, (k, n) in taken.items() if k == n}

    def _pass(self, shards: list[int], damaged: Callable[[list[str]], None]) -> Iterator[dict]:
        """The samples of ``shards`` in turn; the samples lost in a damaged one go to ``damaged``."""
        for s in shards:
            name, n = self.shards[s]
            yield from read_samples(self.location(name), n, damaged)

    def _eval_samples(self, workers: int, worker: int) -> Iterator[dict | str]:
        """This rank's evaluation samples in this worker's shards, in order: raw samples, and for each
        sample lost in a damaged shard its ``"<shard>#<k>"``."""
        start = 0
        for s, (name, n) in enumerate(self.shards):
            if s % workers == worker:
                lost: list[str] = []
                for j, raw in enumerate(read_samples(self.location(name), n, lost.extend)):
                    if (start + j) % self.world == self.rank:
                        yield raw
                for j, where in zip(range(n - len(lost), n), lost):
                    if (start + j) % self.world == self.rank:
                        yield where
            start += n

    def _eval(self, workers: int, worker: int, skip: int) -> Iterator[dict]:
        """One item per sample: the decoded one, or for an unreadable or lost one a ``stand_in`` copy of a
        readable neighbour (the last one before it, else the first after), which the evaluation collate
        drops — so every rank runs the batches ``eval_batches`` counts and no sample is scored twice."""
        last, pending = None, []  # the last readable item; the bad samples met before the first one
        for sample in self._eval_samples(workers, worker):
            item = self._decoded(sample) if isinstance(sample, dict) else None
            if item is None:
                where = _where(sample) if isinstance(sample, dict) else sample
                if last is None:
                    pending.append(where)
                else:
                    yield stand_in(last, [where])
                continue
            item["bad_samples"] = []
            last = item
            yield item
            yield from (stand_in(item, [where]) for where in pending)
            pending = []
        if pending:  # nothing readable in this worker's part: its samples were each named
            log.warning(
                "%s: no readable evaluation sample among %d in one worker's shards", self.root, len(pending)
            )


def _where(raw: dict) -> str:
    """``shard:key``: how a sample of a shard is named."""
    return f"{raw.get('__url__')}:{raw.get('__key__')}"


def buffer_shuffled(samples: Iterator[dict], size: int, rng: random.Random) -> Iterator[dict]:
    """WebDataset's shuffle: hold ``size`` samples, emit a random one as each new one arrives, then drain
    the rest in random order when the stream ends."""
    buffer: list[dict] = []
    for sample in samples:
        buffer.append(sample)
        if len(buffer) >= size:
            yield buffer.pop(rng.randrange(len(buffer)))
    rng.shuffle(buffer)
    yield from buffer


# --------------------------------------------------------------------------- decoding per modality
def media_bytes(raw: dict, modality: str) -> bytes:
    """The bytes of the sample's ``modality`` file (``image``: any extension Pillow reads, ``audio``: any
    container libsndfile reads, as the folders); raises ``DataError``."""
    exts = image_extensions() if modality == "image" else audio_extensions()
    for key, value in raw.items():
        if not key.startswith("__") and f".{key.lower()}" in exts:
            return value
    raise DataError(
        f"sample {raw.get('__key__')} has no {modality} file (.{', .'.join(e[1:] for e in exts[:8])}, …)"
    )


def image_decoder(transform) -> Callable[[dict], dict]:
    """Raw sample → ``{"image", "label"}`` through the image tokenizer's data side (load, augment)."""

    def decode(raw: dict) -> dict:
        from PIL import Image

        with Image.open(io.BytesIO(media_bytes(raw, "image"))) as im:
            im.load()
            pixels = transform.load(im)
        return {"image": transform.augment(pixels), "label": int(raw["cls"])}

    return decode


def audio_decoder(preprocess) -> Callable[[dict], dict]:
    """Raw sample → ``{"audio", "label", "path"}`` through the audio tokenizer's data side."""

    def decode(raw: dict) -> dict:
        wave = load_complete(preprocess, io.BytesIO(media_bytes(raw, "audio")), _where(raw))
        return {"audio": wave, "label": int(raw["cls"]), "path": _where(raw)}

    return decode


def text_decoder(tokenizer, seq_len: int) -> Callable[[dict], dict]:
    """Raw sample → one padded document (``bos`` + tokens + ``eos``, truncated), as ``PaddedText``."""

    def decode(raw: dict) -> dict:
        text = raw["txt"].decode("utf-8") if isinstance(raw["txt"], bytes) else raw["txt"]
        toks = [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id][:seq_len]
        ids = torch.full((seq_len,), tokenizer.pad_id, dtype=torch.long)
        ids[: len(toks)] = torch.tensor(toks, dtype=torch.long)
        valid = torch.zeros(seq_len, dtype=torch.bool)
        valid[: len(toks)] = True
        return {"text": ids, "text_valid": valid, "text_document": torch.zeros(seq_len, dtype=torch.long)}

    return decode
