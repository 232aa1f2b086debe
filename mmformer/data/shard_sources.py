"""Other people's WebDataset shards: a ``data.root`` that names shards by URL, brace pattern or folder,
with or without mmformer's ``index.json``, and several sources mixed in one task (OpenCLIP's ``::``).

A source spec (``data.root``, ``data.val_root``) is one or more parts joined by ``::``; each part is
expanded the way OpenCLIP / WebDataset expand ``--train-data`` (``webdataset.shardlists.expand_urls``:
``WDS_``-prefixed environment variables, then braces ``shards-{000000..000009}.tar``) and is:

- a folder with mmformer's ``index.json`` (``mmformer data shard``): its ``train_split`` / ``val_split``;
- a folder of tar shards without one: ``<folder>/<split>/*.tar``, else the ``*.tar`` whose name begins
  with the split (``train-000000.tar``), else — for training, or for ``val_root`` — all of its ``*.tar``;
- shard URLs read through ``webdataset.gopen`` (``pipe:CMD``, ``file:PATH``, ``http(s)://…``) or local
  paths, possibly with shell globs (``*``, ``?``).

Shards without ``index.json`` are counted once: one pass over each shard, grouping its files into
samples by WebDataset's ``__key__`` (``read_samples``), which also notes the extensions a sample has and
its ``cls`` labels. The counts are cached in ``.mmformer-counts-<digest>.json`` beside local shards (in
``$MMFORMER_DATA/.cache/shard-counts/`` when that folder is not writable or the shards are URLs) and
recounted when a local shard's size or modification time changes; a URL's count is trusted until its
cache file is deleted. What a foreign shard holds is read from those extensions: image or audio bytes
with ``.cls`` (an integer label) — labelled media; with ``.txt`` — captions (the caption id is a hash of
the text); ``.txt`` alone — text documents.

Mixing (``data.upsampling_factors``, OpenCLIP's ``--train-data-upsampling-factors``): each training
epoch visits the shards of source ``i`` ``f_i`` times over: ``floor(f_i)`` times each, plus a seeded draw
of ``round(frac(f_i) · shards_i)`` of them once more (shard granularity, as OpenCLIP's resampling), so
an epoch holds about ``Σ f_i · samples_i`` samples. The draw is a function of ``(seed, epoch)``; the
visits are then dealt out by rank and worker as any shard list (``ShardStream``), so a run resumed
mid-epoch reads exactly what the uninterrupted one would. Evaluation reads every sample once, unmixed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import did_you_mean
from .datamodule import TaskData
from .folders import audio_extensions, image_extensions
from .roots import DataError, data_root, resolve_root
from .shards import INDEX, ShardStream, is_url, read_index, read_samples

log = logging.getLogger("mmformer.data")

COUNTS_FORMAT = "mmformer-shard-counts/1"


@dataclass
class ShardSet:
    """The shards a task reads: ``splits`` maps ``train`` / ``val`` to ``[[location, samples], …]``
    (locations: absolute paths or URLs), ``sources`` the ``(first, end)`` range of each ``::`` part's
    training shards in that list, ``modalities`` what the shards can be read as (most specific first),
    ``classes`` the class names (``[]`` unknown), ``root`` a local folder for caches and messages."""

    root: Path
    splits: dict[str, list[list]]
    sources: list[tuple[int, int]]
    modalities: list[str]
    classes: list[str] = field(default_factory=list)
    max_label: int | None = None  # foreign labelled shards: the largest ``cls`` counted

    def info(self, modality: str) -> dict:
        """An ``index.json``-shaped dict (``read_index``'s) for the readers that take one."""
        return {"modality": modality, "classes": self.classes, "splits": self.splits}


def split_parts(spec: str) -> list[str]:
    """``a::b`` → ``["a", "b"]`` (empty parts refused)."""
    parts = [p.strip() for p in str(spec).split("::")]
    if not all(parts):
        raise DataError(f"shard spec {spec!r} has an empty part between '::'")
    return parts


def expand(part: str) -> list[str]:
    """One spec part → its URLs / paths: ``WDS_`` environment variables and braces, as WebDataset."""
    from webdataset.shardlists import expand_urls

    return expand_urls(part)


def open_sources(spec: str, split: str, whole: bool, counts_dir: Path | None = None) -> ShardSet:
    """The ``split`` shards of every ``::`` part of ``spec``. ``whole``: a part without that split gives
    all of its shards (training data; ``val_root``). Raises ``DataError`` naming the part when it has
    no such split, no shards, or sources that disagree on what they hold; ``DataNotFoundError`` for a
    local path that does not exist."""
    sets = [_open_part(part, split, whole, counts_dir) for part in split_parts(spec)]
    shards, sources = [], []
    for s in sets:
        sources.append((len(shards), len(shards) + len(s.splits[split])))
        shards += s.splits[split]
    common = [m for m in sets[0].modalities if all(m in s.modalities for s in sets)]
    if not common:
        what = "; ".join(f"{p}: {'/'.join(s.modalities)}" for p, s in zip(split_parts(spec), sets))
        raise DataError(f"the sources of {spec!r} hold different kinds of samples ({what})")
    named = [s.classes for s in sets if s.classes and s.max_label is None]
    if any(c != named[0] for c in named):
        raise DataError(f"the sources of {spec!r} have different class lists: {named}")
    labels = [s.max_label for s in sets if s.max_label is not None]
    return ShardSet(
        sets[0].root,
        {split: shards},
        sources,
        common,
        named[0] if named else [],
        max(labels) if labels and not named else None,
    )


def _open_part(part: str, split: str, whole: bool, counts_dir: Path | None) -> ShardSet:
    urls = expand(part)
    if len(urls) == 1 and not is_url(urls[0]) and not _globbed(urls[0]):
        path = resolve_root(urls[0])
        if path.is_dir():
            return _open_folder(path, split, whole, counts_dir)
        urls = [str(path)]
    found = []
    for u in urls:  # local globs; URLs and plain paths as they are
        if not is_url(u) and _globbed(u):
            found += sorted(glob.glob(u))
        else:
            found.append(u)
    if not whole:
        raise DataError(
            f"{part!r} lists shards without splits: give the evaluation shards as data.val_root "
            "(OpenCLIP's --val-data)"
        )
    if not found:
        raise DataError(f"{part!r} names no shards (after expanding braces and globs)")
    missing = [u for u in found if not is_url(u) and not Path(u).is_file()]
    if missing:
        raise DataError(
            f"{part!r}: shard {missing[0]} does not exist ({len(missing)} of {len(found)} missing)"
        )
    locations = [u if is_url(u) else str(Path(u).resolve()) for u in found]
    return _counted(locations, split, counts_dir)


def _globbed(path: str) -> bool:
    return any(c in path for c in "*?[")


def _open_folder(folder: Path, split: str, whole: bool, counts_dir: Path | None) -> ShardSet:
    if (folder / INDEX).is_file():
        info = read_index(folder)
        if split not in info["splits"]:
            raise DataError(f"{folder} has no {split!r} shards (splits: {', '.join(info['splits'])})")
        shards = [[str((folder / name).resolve()), n] for name, n in info["splits"][split]]
        return ShardSet(folder, {split: shards}, [(0, len(shards))], [info["modality"]], info["classes"])
    if (folder / split).is_dir():
        tars = sorted((folder / split).glob("*.tar"))
    else:
        every = sorted(folder.glob("*.tar"))
        groups: dict[str, list[Path]] = {}
        for t in every:
            groups.setdefault(re.sub(r"[-_.]?\d+$", "", t.stem), []).append(t)
        tars = groups.get(split) or (every if whole else [])
        if not tars:
            found = ", ".join(sorted(groups)) or "none"
            hint = "" if every else " and no *.tar"
            raise DataError(
                f"{folder} has no index.json{hint}, no {split}/ folder and no {split}-*.tar shards (shard "
                f"name prefixes: {found}); name them so, or give the evaluation shards as data.val_root"
            )
    if not tars:
        raise DataError(f"{folder / split} holds no *.tar shards")
    return _counted([str(t.resolve()) for t in tars], split, counts_dir, folder)


# --------------------------------------------------------------------------- counting
def _counted(
    locations: list[str], split: str, counts_dir: Path | None, folder: Path | None = None
) -> ShardSet:
    """A ``ShardSet`` of foreign shards, their counts read from the cache or counted (one pass)."""
    digest = hashlib.sha256("\n".join(locations).encode()).hexdigest()[:16]
    local = [Path(u) for u in locations if not is_url(u)]
    beside = folder or (local[0].parent if len(local) == len(locations) else None)
    caches = [p for p in (beside, counts_dir or data_root() / ".cache" / "shard-counts") if p is not None]
    name = f".mmformer-counts-{digest}.json"
    counted = next((c for c in (_read_counts(d / name, locations) for d in caches) if c), None)
    if counted is None:
        counted = count_shards(locations)
        where = _write_counts(caches, name, counted)
        log.info(
            "%d shard(s) without %s (%s … ): counted %d samples (files grouped by __key__; extensions %s) "
            "in one pass%s",
            len(locations), INDEX, locations[0], sum(n for _, n in counted["shards"]),
            "/".join(counted["extensions"]) or "none",
            f", cached in {where}" if where else " (no writable cache folder: counted again next time)",
        )  # fmt: skip
    shards = [[u, n] for u, n in counted["shards"]]
    root = beside or caches[-1]
    return ShardSet(root, {split: shards}, [(0, len(shards))], *_kinds(counted))


def count_shards(locations: list[str]) -> dict:
    """One pass over each shard: ``{"format", "shards": [[location, samples], …], "extensions": sorted
    file extensions seen, "max_label": the largest integer ``cls`` (None: none), "stamps": local files'
    [size, mtime_ns]}``. A damaged shard counts its readable samples (named once in a warning)."""
    shards, exts, max_label = [], set(), None
    for u in locations:
        n = 0
        for raw in read_samples(u, None, lambda lost: None):
            n += 1
            exts.update(k for k in raw if not k.startswith("__"))
            label = _label(raw.get("cls"))
            if label is not None:
                max_label = label if max_label is None else max(max_label, label)
        shards.append([u, n])
    return {
        "format": COUNTS_FORMAT,
        "shards": shards,
        "extensions": sorted(exts),
        "max_label": max_label,
        "stamps": _stamps(locations),
    }


def _label(value) -> int | None:
    try:
        return int(value.decode() if isinstance(value, bytes) else value)
    except (TypeError, ValueError, UnicodeDecodeError):
        return None


def _stamps(locations: list[str]) -> list:
    out = []
    for u in locations:
        st = None if is_url(u) else os.stat(u)
        out.append(None if st is None else [st.st_size, st.st_mtime_ns])
    return out


def _read_counts(path: Path, locations: list[str]) -> dict | None:
    """The cached counts at ``path`` when they are for these shards, unchanged since; else None."""
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict) or cached.get("format") != COUNTS_FORMAT:
        return None
    if [u for u, _ in cached.get("shards", [])] != locations or cached.get("stamps") != _stamps(locations):
        return None
    return cached


def _write_counts(folders: list[Path], name: str, counted: dict) -> Path | None:
    """Write the counts into the first writable folder (atomic: ranks may count at once)."""
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{name}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(counted))
            os.replace(tmp, folder / name)
            return folder / name
        except OSError:
            continue
    return None


def _kinds(counted: dict) -> tuple[list[str], list[str], int | None]:
    """``(modalities, classes, max_label)`` of foreign shards from the extensions their samples have."""
    exts = {f".{e.lower()}" for e in counted["extensions"]}
    media = "image" if exts & set(image_extensions()) else "audio" if exts & set(audio_extensions()) else None
    kinds = []
    if media and ".cls" in exts:
        kinds.append(media)
    if media and ".txt" in exts:
        kinds.append(f"{media}_caption")
    if not media and ".txt" in exts:
        kinds.append("text")
    max_label = counted.get("max_label") if media and ".cls" in exts else None
    return kinds or ["unknown"], [], max_label


# --------------------------------------------------------------------------- mixing
class MixedShardStream(ShardStream):
    """A training ``ShardStream`` over several sources, source ``i`` upsampled by ``factors[i]`` (see the
    module docstring). ``sources``: each source's ``(first, end)`` range in ``shards``; the rest as
    ``ShardStream``. Raises ``DataError`` for a factor count that differs from the sources' or a factor
    below 0."""

    def __init__(self, root, shards, sources, factors, decode, batch_size, **common):
        if len(factors) != len(sources):
            raise DataError(f"{len(factors)} upsampling factors for {len(sources)} '::' sources")
        if any(not math.isfinite(f) or f < 0 for f in factors) or not any(factors):
            raise DataError(f"upsampling factors must be >= 0 and not all 0, got {list(factors)}")
        self.sources, self.factors = list(sources), [float(f) for f in factors]
        super().__init__(root, shards, decode, True, batch_size, **common)

    def epoch_samples(self) -> int:
        return round(
            sum(f * sum(n for _, n in self.shards[a:b]) for (a, b), f in zip(self.sources, self.factors))
        )

    def epoch_order(self) -> list[int]:
        visits: list[int] = []
        for i, ((a, b), f) in enumerate(zip(self.sources, self.factors)):
            whole, extra = int(f), round((f - int(f)) * (b - a))
            rng = random.Random(hash((self.seed, self.epoch, i)))  # ints only: the same in every process
            visits += list(range(a, b)) * whole + rng.sample(range(a, b), extra)
        random.Random(hash((self.seed, self.epoch))).shuffle(visits)
        return visits


# --------------------------------------------------------------------------- the data kind's builder
def shards_data(
    cfg,
    task_kind: str,
    decoders: dict[str, Callable],
    seed: int,
    num_classes: int | None = None,
    packed: Callable | None = None,
) -> TaskData:
    """``TaskData`` for ``data.kind: shards``: ``decoders`` maps what the shards hold (``image``,
    ``audio``, ``text``, ``image_caption``, ``audio_caption``) to ``(train decode, val decode,
    collate)``; ``packed(root, info, split, batch_size=, seed=, shuffle_buffer=)``, when given, builds
    the training stream instead (packed text windows, ``packed_shards``). ``cfg.root`` / ``cfg.val_root``
    are source specs (module docstring); ``cfg.upsampling_factors`` mixes the ``::`` sources.

    Raises ``DataError`` for shards this task cannot read, a class count that differs from the head's
    (a foreign shard's ``cls`` at or above ``num_classes``), a missing split, or mixing packed text."""
    factors = list(cfg.upsampling_factors or [])
    parts = split_parts(cfg.root)
    if len(parts) == 1 and not cfg.val_root and not factors and _indexed_folder(parts[0]):
        root = resolve_root(parts[0])  # mmformer's own shard folder: names relative to it, as written
        info = read_index(root)
        train_shards, val_shards = (_split(root, info, s) for s in (cfg.train_split, cfg.val_split))
        modalities, classes, max_label = [info["modality"]], info["classes"], None
        sources = [(0, len(train_shards))]
    else:
        train = open_sources(cfg.root, cfg.train_split, True)
        val = open_sources(cfg.val_root or cfg.root, cfg.val_split, bool(cfg.val_root))
        root, train_shards, val_shards = train.root, train.splits[cfg.train_split], val.splits[cfg.val_split]
        sources = train.sources
        modalities = [m for m in train.modalities if m in val.modalities] or train.modalities
        classes, max_label = train.classes or val.classes, _max(train.max_label, val.max_label)
        info = {"modality": None, "classes": classes, "splits": {cfg.train_split: train_shards}}
    modality = next((m for m in modalities if m in decoders), None)
    if modality is None:
        wanted = " or ".join(decoders)
        raise DataError(
            f"{cfg.root} holds {'/'.join(modalities)} shards; a {task_kind} task here reads {wanted} shards "
            f"(write them with `mmformer data shard SRC --out DIR --modality {next(iter(decoders))}`, or as "
            "WebDataset samples: image/audio bytes + .cls for labels, + .txt for captions, .txt for text)"
        )
    info["modality"] = modality
    if num_classes is not None and classes and len(classes) != num_classes:
        raise DataError(f"{cfg.root} has {len(classes)} classes but the head has num_classes={num_classes}")
    if num_classes is not None and max_label is not None and max_label >= num_classes:
        raise DataError(
            f"{cfg.root}: the shards' .cls labels go up to {max_label} but the head has "
            f"num_classes={num_classes}"
        )
    train_decode, val_decode, collate = decoders[modality]
    val_batch = cfg.val_batch_size or cfg.batch_size
    common = {"seed": seed, "shuffle_buffer": cfg.shuffle_buffer}
    if packed is not None and factors:
        raise DataError("data.upsampling_factors does not mix packed text (pack: true): remove one of them")
    if packed is not None:
        stream = packed(root, info, cfg.train_split, batch_size=cfg.batch_size, **common)
    elif factors:
        stream = MixedShardStream(
            root, train_shards, sources, factors, train_decode, cfg.batch_size, **common
        )
    else:
        stream = ShardStream(root, train_shards, train_decode, True, cfg.batch_size, **common)
    return TaskData(
        train=stream,
        val=ShardStream(root, val_shards, val_decode, False, val_batch, **common),
        collate=collate,
        batch_size=cfg.batch_size,
        val_batch_size=val_batch,
        num_workers=cfg.num_workers,
        drop_last=True,
    )


def _indexed_folder(part: str) -> bool:
    urls = expand(part)
    if len(urls) != 1 or is_url(urls[0]) or _globbed(urls[0]):
        return False
    return (resolve_root(urls[0]) / INDEX).is_file()


def _split(root: Path, info: dict, split: str) -> list[list]:
    if split not in info["splits"]:
        raise DataError(
            f"{root} has no {split!r} shards (splits: {', '.join(info['splits'])})"
            f"{did_you_mean(split, info['splits'])}"
        )
    return info["splits"][split]


def _max(*labels: int | None) -> int | None:
    found = [x for x in labels if x is not None]
    return max(found) if found else None
