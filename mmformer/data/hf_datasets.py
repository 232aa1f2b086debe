"""Local Hugging Face ``datasets`` (Arrow folders written by ``save_to_disk``, or Parquet files) as a data
kind (``data.kind: hf_dataset``), read without the Hub: ``datasets`` is an optional dependency
(``pip install mmformer[hf]``).

``root`` is either a folder written by ``Dataset(Dict).save_to_disk`` (``datasets.load_from_disk``) or a
folder of Parquet files (``datasets.load_dataset("parquet", data_files=…)``), a file belonging to the
split whose name begins its file name (``train-00000-of-00001.parquet``) or names its folder
(``validation/0.parquet``), as the Hub lays them out. Each row becomes the WebDataset sample the shard
readers decode (``shards``, ``caption_shards``), so items and batches equal those of the shards:

- ``image``: an ``Image`` feature (encoded bytes or a file path), raw bytes, or a ``(H, W[, C])`` uint8
  array → the image bytes;
- ``audio``: an ``Audio`` feature (bytes or path; not decoded by ``datasets``, which would need
  torchcodec) or ``{"array", "sampling_rate"}`` → the audio bytes;
- ``label``: a ``ClassLabel`` (its names are the classes), strings (the sorted distinct training labels
  are the classes) or integers → ``.cls``;
- ``text``: a string column → ``.txt`` (documents, or captions with a caption id from their text).

Which column is which field is ``data.columns`` (``{image: img, label: fine_label}``); a field not
mapped reads the column of its own name. A missing column is named with the columns there are.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import soundfile
from PIL import Image
from torch.utils.data import Dataset

from ..errors import did_you_mean
from .bad_samples import STAND_IN, first_readable
from .caption_shards import text_id
from .datamodule import TaskData
from .roots import DataError, data_root, resolve_root

FIELDS = ("image", "audio", "label", "text")


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError(
            "data.kind: hf_dataset reads Hugging Face datasets, which is not installed: "
            "pip install mmformer[hf]"
        ) from None
    return datasets


def load_splits(root: Path, splits: list[str]) -> dict:
    """``{split: datasets.Dataset}`` of ``splits`` from a ``save_to_disk`` folder or Parquet files.
    Raises ``DataError`` naming a missing split with the ones there are."""
    datasets = _datasets()
    if (root / "dataset_dict.json").is_file() or (root / "state.json").is_file():
        loaded = datasets.load_from_disk(str(root))
        if isinstance(loaded, datasets.Dataset):
            raise DataError(
                f"{root} holds a single Dataset: save a DatasetDict with {' and '.join(splits)} splits"
            )
        found = dict(loaded)
    else:
        files: dict[str, list[str]] = {}
        for f in sorted(root.rglob("*.parquet")):
            names = {re.split(r"[-_.]", f.stem)[0], f.parent.name if f.parent != root else ""}
            for split in names & set(splits):
                files.setdefault(split, []).append(str(f))
        if not files:
            raise DataError(f"{root} is neither a save_to_disk folder nor holds <split>*.parquet files")
        found = datasets.load_dataset(
            "parquet", data_files=files, cache_dir=str(data_root() / ".cache" / "hf-datasets")
        )
        found = dict(found)
    for split in splits:
        if split not in found:
            raise DataError(
                f"{root} has no {split!r} split (splits: {', '.join(found)}){did_you_mean(split, found)}"
            )
    return {s: found[s] for s in splits}


def column(table, field: str, columns: dict[str, str], where: str) -> str:
    """The column that holds ``field``; raises ``DataError`` naming it and the columns there are."""
    name = columns.get(field, field)
    if name not in table.column_names:
        known = ", ".join(table.column_names)
        hint = did_you_mean(name, table.column_names)
        how = "" if field in columns else f" (map another with data.columns.{field})"
        raise DataError(f"{where} has no column {name!r} for the {field}{how}; columns: {known}.{hint}")
    return name


def class_names(table, name: str) -> tuple[list[str], int | None]:
    """``(class names, None)`` of a ``ClassLabel`` or string label column; ``([], max)`` for integers."""
    feature = table.features[name]
    if hasattr(feature, "names"):
        return list(feature.names), None
    values = table.unique(name)
    if all(isinstance(v, str) for v in values):
        return sorted(values), None
    return [], max(int(v) for v in values)


class HFSamples(Dataset):
    """Rows of a ``datasets.Dataset`` as decoded items (``decode``: a shard decoder, raw WebDataset
    sample → item). ``fields``: field → column of the ones this task reads; ``classes``: string labels →
    index. An unreadable row is named (``<root>[<split>]#<row>``) and the next readable one stands in."""

    def __init__(
        self, table, fields: dict[str, str], decode: Callable[[dict], dict], where: str, classes=None
    ):
        datasets = _datasets()
        for f in ("image", "audio"):  # keep the encoded bytes: the decoders read them as a shard's
            if f in fields and isinstance(table.features[fields[f]], (datasets.Image, datasets.Audio)):
                table = table.cast_column(fields[f], type(table.features[fields[f]])(decode=False))
        self.table, self.fields, self.decode, self.where = table, fields, decode, where
        self.classes = list(classes or [])  # the names (media pictures title rows with them)
        self.class_index = {c: i for i, c in enumerate(self.classes)}

    def __len__(self) -> int:
        return len(self.table)

    def raw(self, j: int) -> dict:
        """Row ``j`` as a WebDataset sample: ``{"__key__", "__url__", "png"|"wav": bytes, "cls", "txt"}``."""
        row = self.table[j]
        raw = {"__key__": str(j), "__url__": self.where}
        if "image" in self.fields:
            raw["png"] = _media_bytes(row[self.fields["image"]], "image")
        if "audio" in self.fields:
            raw["wav"] = _media_bytes(row[self.fields["audio"]], "audio")
        if "label" in self.fields:
            label = row[self.fields["label"]]
            raw["cls"] = self.class_index[label] if isinstance(label, str) else int(label)
        if "text" in self.fields:
            raw["txt"] = str(row[self.fields["text"]])
            raw["cid"] = text_id(raw["txt"])
        return raw

    def __getitem__(self, i: int) -> dict:
        j, item, bad = first_readable(
            i,
            len(self),
            lambda k: self.decode(self.raw(k)),
            lambda k: f"{self.where}#{k}",
            "row",
            (Exception,),
        )
        item["bad_samples"] = bad
        if j != i:
            item[STAND_IN] = True
        return item


def _media_bytes(value, what: str) -> bytes:
    """Encoded bytes of an image or audio cell (see the module docstring); raises ``ValueError``."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, dict) and value.get("bytes"):
        return value["bytes"]
    if isinstance(value, dict) and value.get("path"):
        return Path(value["path"]).read_bytes()
    if isinstance(value, dict) and "array" in value:
        buf = io.BytesIO()
        soundfile.write(
            buf, np.asarray(value["array"], dtype="float32"), int(value["sampling_rate"]), format="WAV"
        )
        return buf.getvalue()
    if what == "image" and value is not None:
        buf = io.BytesIO()
        Image.fromarray(np.asarray(value, dtype=np.uint8)).save(buf, format="PNG")
        return buf.getvalue()
    raise ValueError(f"no {what} in this row ({type(value).__name__})")


def hf_data(cfg, modality: str, decoders: tuple, num_classes: int | None = None) -> TaskData:
    """``TaskData`` for ``data.kind: hf_dataset``. ``modality``: what the task reads (``image``,
    ``audio`` — with labels —, ``text``, ``image_caption``, ``audio_caption``); ``decoders``: its
    ``(train decode, val decode, collate)``. Raises ``DataError`` for a missing split or column, or
    classes that do not match the head's ``num_classes``; ``DataNotFoundError`` for a missing root."""
    root = resolve_root(cfg.root)
    tables = load_splits(root, [cfg.train_split, cfg.val_split])
    wanted = {
        "image": ("image", "label"),
        "audio": ("audio", "label"),
        "text": ("text",),
        "image_caption": ("image", "text"),
        "audio_caption": ("audio", "text"),
    }[modality]
    unknown = set(cfg.columns) - set(FIELDS)
    if unknown:
        bad = sorted(unknown)[0]
        raise DataError(
            f"data.columns: unknown field {bad!r}; fields: {', '.join(FIELDS)}.{did_you_mean(bad, FIELDS)}"
        )
    fields = {s: {f: column(t, f, cfg.columns, f"{root} [{s}]") for f in wanted} for s, t in tables.items()}
    classes: list[str] = []
    if "label" in wanted:
        classes, max_label = class_names(tables[cfg.train_split], fields[cfg.train_split]["label"])
        if num_classes is not None and classes and len(classes) != num_classes:
            raise DataError(f"{root} has {len(classes)} classes but the head has num_classes={num_classes}")
        if num_classes is not None and max_label is not None and max_label >= num_classes:
            raise DataError(f"{root}: labels go up to {max_label} but the head has num_classes={num_classes}")
    train_decode, val_decode, collate = decoders
    train, val = (
        HFSamples(tables[s], fields[s], d, f"{root}[{s}]", classes)
        for s, d in ((cfg.train_split, train_decode), (cfg.val_split, val_decode))
    )
    return TaskData(
        train=train,
        val=val,
        collate=collate,
        batch_size=cfg.batch_size,
        val_batch_size=cfg.val_batch_size or cfg.batch_size,
        num_workers=cfg.num_workers,
        drop_last=cfg.drop_last,
    )
