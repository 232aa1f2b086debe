"""Image datasets returning the fixed batch keys ``image`` (C, H, W) uint8 and ``label`` long.

``ImageFolder``: ``<root>/<split>/<class name>/<file>``, the class index is the position of the
sub-folder in sorted order of the training split (torchvision ``ImageFolder`` convention). Every
extension Pillow reads is an image (``folders.image_extensions``); other files are counted in one warning,
and a class folder without an image is refused. Unreadable images follow the folder rule
(``bad_samples``): named once, replaced by the next readable image (so batch shapes stay fixed and DDP
ranks stay in step) and listed in the item under ``bad_samples``; evaluation loaders drop that row.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from .bad_samples import STAND_IN, first_readable
from .folders import class_files, find_classes, image_extensions  # noqa: F401 (find_classes: re-exported)


def decode_errors() -> tuple[type[BaseException], ...]:
    """What PIL raises for missing, truncated or corrupt files: ``OSError`` (``UnidentifiedImageError``
    is one), ``SyntaxError`` (some broken PNG chunks) and ``DecompressionBombError``."""
    from PIL import Image

    return (OSError, SyntaxError, Image.DecompressionBombError)


class ImageFolder(Dataset):
    """Args:
        split_dir: ``<root>/<split>``.
        classes: class names in label order (take them from the training split).
        transform: the image tokenizer's data-side half (``ImagePreprocess``: ``load`` then ``augment``).
        cache: keep every decoded (resized, not augmented) image in memory after its first read, per
            process — for small datasets, where decoding would otherwise dominate the step time.

    Raises:
        FileNotFoundError: a missing split folder, or one without class folders.
        DataError: a class folder that is not among ``classes``, or one without an image.
    """

    def __init__(self, split_dir: Path, classes: list[str], transform, cache: bool = False):
        self.split_dir, self.classes, self.transform = Path(split_dir), list(classes), transform
        self.cache: dict[int, torch.Tensor] | None = {} if cache else None
        self.samples, _ = class_files(self.split_dir, self.classes, image_extensions(), "image")

    def __len__(self) -> int:
        return len(self.samples)

    def decode(self, i: int):
        """The PIL image of sample ``i``, fully read; raises one of ``decode_errors()`` when unreadable."""
        from PIL import Image

        with Image.open(self.samples[i][0]) as im:
            im.load()
            return im

    def pixels(self, i: int) -> torch.Tensor:
        """Decoded, resized uint8 pixels of sample ``i`` (from the cache when enabled)."""
        cached = self.cache.get(i) if self.cache is not None else None
        if cached is not None:
            return cached
        pixels = self.transform.load(self.decode(i))
        if self.cache is not None:
            self.cache[i] = pixels
        return pixels

    def __getitem__(self, i: int) -> dict:
        j, pixels, bad = first_readable(
            i, len(self.samples), self.pixels, lambda k: self.samples[k][0], "image", decode_errors()
        )
        item = {"image": self.transform.augment(pixels), "label": self.samples[j][1], "bad_samples": bad}
        if bad:
            item[STAND_IN] = True
        return item


class TorchvisionClassification(Dataset):
    """Wrap a torchvision classification dataset (``(PIL image, int)`` items) into mmformer batch keys."""

    def __init__(self, dataset, transform):
        self.dataset, self.transform = dataset, transform
        self.classes = list(getattr(dataset, "classes", []))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        image, label = self.dataset[i]
        return {"image": self.transform(image), "label": int(label), "bad_samples": []}
