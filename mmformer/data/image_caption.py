"""Image–caption data: ``root/<split>.jsonl`` with one ``{"image": path, "caption": text}`` per line
(paths relative to ``root``), e.g. the bundled ``emoji`` set.

Batches: ``image (B, C, H, W)`` uint8, ``caption (B, L)`` long (BOS … EOS, right-padded with the pad id),
``caption_valid (B, L)`` bool (True = real token), ``caption_text`` (the strings), ``caption_id (B,)``
long (equal for captions with equal token ids within the split) and, with a
``label_key``, ``label (B,)`` long: the index of the row's class in ``root/<label_key>.json``
(``{class name: [prompt, …]}``, the zero-shot classes), -1 for a row without one. Captions decoded once,
images once per epoch (or cached). A caption that is not a string (null) is refused naming its line; an
unreadable image follows the folder rule (``bad_samples``): named once, replaced by the next readable
pair in training, left out of evaluation.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Dataset

from ..tokenizers.image import ImagePreprocess
from .bad_samples import STAND_IN, first_readable
from .collate import caption_ids, pad_ids
from .datamodule import TaskData
from .image_folder import decode_errors
from .jsonl import read_jsonl, text_field
from .roots import DataError, resolve_root
from .text import read_utf8


def read_captions(path: Path) -> list[tuple[str, str]]:
    """``(absolute image path, caption)`` rows; raises ``DataError`` naming ``file:line``."""
    return [(image, caption) for image, caption, _ in read_caption_rows(path)]


def read_caption_rows(path: Path, label_key: str | None = None) -> list[tuple[str, str, str | None]]:
    """``(absolute image path, caption, the row's label_key value or None)``; raises ``DataError``
    naming ``file:line``."""
    if not path.is_file():
        raise DataError(f'{path} is missing (one {{"image": …, "caption": …}} per line)')
    rows = []
    for n, row in read_jsonl(path, ("image", "caption")):
        image = Path(text_field(path, n, row, "image"))
        label = row.get(label_key) if label_key else None
        caption = text_field(path, n, row, "caption")
        rows.append((str(image if image.is_absolute() else path.parent / image), caption, label))
    return rows


def read_class_prompts(root: Path, label_key: str) -> dict[str, list[str]]:
    """``root/<label_key>.json``: class name → its prompts (at least one each), in class order.
    Raises ``DataError`` naming the file."""
    path = root / f"{label_key}.json"
    if not path.is_file():
        raise DataError(f"{path} is missing: label_key {label_key!r} needs its classes and their prompts")
    try:
        classes = json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON ({e})") from None
    if (
        not isinstance(classes, dict)
        or not classes
        or not all(isinstance(p, list) and p and all(isinstance(x, str) for x in p) for p in classes.values())
    ):
        raise DataError(f'{path}: expected {{"class name": ["prompt", …], …}} with a prompt for each class')
    return classes


class ImageCaptions(Dataset):
    """Items ``{"image": (C, H, W) uint8, "ids": [caption token ids], "caption": str, "caption_id": int,
    "bad_samples": [path, …]}``, plus ``"label": int`` when ``labels`` are given."""

    def __init__(
        self,
        rows: list[tuple[str, str]],
        ids: list[list[int]],
        preprocess,
        cache: bool = False,
        labels: list[int] | None = None,
    ):
        self.rows, self.ids, self.preprocess, self.labels = rows, ids, preprocess, labels
        self.caption_ids = caption_ids(ids)
        self.cache: dict[int, torch.Tensor] | None = {} if cache else None

    def __len__(self) -> int:
        return len(self.rows)

    def pixels(self, i: int) -> torch.Tensor:
        """Decoded, resized uint8 pixels of row ``i`` (from the cache when enabled)."""
        pixels = self.cache.get(i) if self.cache is not None else None
        if pixels is None:
            with Image.open(self.rows[i][0]) as im:
                pixels = self.preprocess.load(im)
            if self.cache is not None:
                self.cache[i] = pixels
        return pixels

    def __getitem__(self, i: int) -> dict:
        j, pixels, bad = first_readable(
            i, len(self.rows), self.pixels, lambda k: self.rows[k][0], "image", decode_errors()
        )
        item = {
            "image": self.preprocess.augment(pixels),
            "ids": self.ids[j],
            "caption": self.rows[j][1],
            "caption_id": self.caption_ids[j],
            "bad_samples": bad,
        }
        if self.labels is not None:
            item["label"] = self.labels[j]
        if bad:
            item[STAND_IN] = True
        return item


def collate_captions(samples: list[dict], pad_id: int) -> dict:
    ids, valid = pad_ids([s["ids"] for s in samples], pad_id)
    batch = {
        "image": torch.stack([s["image"] for s in samples]),
        "caption": ids,
        "caption_valid": valid,
        "caption_text": [s["caption"] for s in samples],
        "caption_id": torch.tensor([s["caption_id"] for s in samples], dtype=torch.long),
    }
    if "label" in samples[0]:
        batch["label"] = torch.tensor([s["label"] for s in samples], dtype=torch.long)
    if "bad_samples" in samples[0]:  # the unreadable samples skipped (``BadSampleReport``)
        batch["bad_samples"] = [p for s in samples for p in s["bad_samples"]]
    return batch


def encode_captions(tokenizer, captions: list[str], max_len: int) -> list[list[int]]:
    """BOS + tokens + EOS, cut to ``max_len`` keeping the EOS."""
    ids = tokenizer.encode_batch(captions, bos=True, eos=True)
    return [s[: max_len - 1] + [s[-1]] if len(s) > max_len else s for s in ids]


def image_caption_data(cfg, tok_cfg, tokenizer):
    """``TaskData`` for an ``ImageCaptionDataConfig``; ``tok_cfg`` gives the image size and channels,
    ``tokenizer`` (a ``TextTokenizer``) encodes the captions."""

    root = resolve_root(cfg.root)
    preprocess = ImagePreprocess(tok_cfg.image_size, tok_cfg.in_chans)

    index = None
    if cfg.label_key:
        index = {name: i for i, name in enumerate(read_class_prompts(root, cfg.label_key))}

    def make(split: str) -> ImageCaptions:
        rows = read_caption_rows(root / f"{split}.jsonl", cfg.label_key)
        labels = None if index is None else [index.get(label, -1) for _, _, label in rows]
        return ImageCaptions(
            [(p, c) for p, c, _ in rows],
            encode_captions(tokenizer, [c for _, c, _ in rows], cfg.max_len),
            preprocess,
            cfg.cache,
            labels,
        )

    train, val = make(cfg.train_split), make(cfg.val_split)

    def sources(ds: ImageCaptions) -> list[str]:  # the images (a caption may describe several)
        return [p for p, _ in ds.rows]

    return TaskData(
        train=train,
        val=val,
        train_sources=sources(train),
        val_sources=sources(val),
        collate=functools.partial(collate_captions, pad_id=tokenizer.pad_id),
        batch_size=cfg.batch_size,
        val_batch_size=cfg.val_batch_size or cfg.batch_size,
        num_workers=cfg.num_workers,
        drop_last=cfg.drop_last,
    )
