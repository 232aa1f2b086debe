"""Image–caption data: ``root/<split>.jsonl`` with one ``{"image": path, "caption": text}`` per line
(paths relative to ``root``), e.g. the bundled ``emoji`` set.

Batches: ``image (B, C, H, W)`` uint8, ``caption (B, L)`` long (BOS … EOS, right-padded with the pad id),
``caption_valid (B, L)`` bool (True = real token). Captions decoded once, images once per epoch (or
cached).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Dataset

from .collate import pad_ids
from .jsonl import read_jsonl
from .roots import DataError


def read_captions(path: Path) -> list[tuple[str, str]]:
    """``(absolute image path, caption)`` rows; raises ``DataError`` naming ``file:line``."""
    if not path.is_file():
        raise DataError(f'{path} is missing (one {{"image": …, "caption": …}} per line)')
    rows = []
    for _, row in read_jsonl(path, ("image", "caption")):
        image = Path(row["image"])
        rows.append((str(image if image.is_absolute() else path.parent / image), str(row["caption"])))
    return rows


class ImageCaptions(Dataset):
    """Items ``{"image": (C, H, W) uint8, "ids": [caption token ids], "caption": str}``."""

    def __init__(self, rows: list[tuple[str, str]], ids: list[list[int]], preprocess, cache: bool = False):
        self.rows, self.ids, self.preprocess = rows, ids, preprocess
        self.cache: dict[int, torch.Tensor] | None = {} if cache else None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        pixels = self.cache.get(i) if self.cache is not None else None
        if pixels is None:
            path = self.rows[i][0]
            try:
                with Image.open(path) as im:
                    pixels = self.preprocess.load(im)
            except OSError as e:
                raise DataError(f"unreadable image {path}: {e}") from None
            if self.cache is not None:
                self.cache[i] = pixels
        return {"image": self.preprocess.augment(pixels), "ids": self.ids[i], "caption": self.rows[i][1]}


def collate_captions(samples: list[dict], pad_id: int) -> dict:
    ids, valid = pad_ids([s["ids"] for s in samples], pad_id)
    return {
        "image": torch.stack([s["image"] for s in samples]),
        "caption": ids,
        "caption_valid": valid,
        "caption_text": [s["caption"] for s in samples],
    }


def encode_captions(tokenizer, captions: list[str], max_len: int) -> list[list[int]]:
    """BOS + tokens + EOS, cut to ``max_len`` keeping the EOS."""
    ids = tokenizer.encode_batch(captions, bos=True, eos=True)
    return [s[: max_len - 1] + [s[-1]] if len(s) > max_len else s for s in ids]


def image_caption_data(cfg, tok_cfg, tokenizer):
    """``TaskData`` for an ``ImageCaptionDataConfig``; ``tok_cfg`` gives the image size and channels,
    ``tokenizer`` (a ``TextTokenizer``) encodes the captions."""
    from ..tokenizers.image import ImagePreprocess
    from .datamodule import TaskData
    from .roots import resolve_root

    root = resolve_root(cfg.root)
    preprocess = ImagePreprocess(tok_cfg.image_size, tok_cfg.in_chans)

    def make(split: str) -> ImageCaptions:
        rows = read_captions(root / f"{split}.jsonl")
        return ImageCaptions(
            rows, encode_captions(tokenizer, [c for _, c in rows], cfg.max_len), preprocess, cfg.cache
        )

    return TaskData(
        train=make(cfg.train_split),
        val=make(cfg.val_split),
        collate=functools.partial(collate_captions, pad_id=tokenizer.pad_id),
        batch_size=cfg.batch_size,
        val_batch_size=cfg.val_batch_size or cfg.batch_size,
        num_workers=cfg.num_workers,
        drop_last=cfg.drop_last,
    )
