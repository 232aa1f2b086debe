"""Image datasets returning the fixed batch keys ``image`` (C, H, W) uint8 and ``label`` long.

``ImageFolder``: ``<root>/<split>/<class name>/<file>``, the class index is the position of the
sub-folder in sorted order of the training split (torchvision ``ImageFolder`` convention).
Unreadable images are reported with their path, replaced by the next readable sample (so batch
shapes stay fixed and DDP ranks stay in step) and listed in the batch under ``bad_samples``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.utils.data import Dataset

from .roots import DataError

log = logging.getLogger("mmformer.data")

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
MAX_CONSECUTIVE_BAD = 50


def _decode_errors() -> tuple[type[BaseException], ...]:
    """What PIL raises for missing, truncated or corrupt files: ``OSError`` (``UnidentifiedImageError``
    is one), ``SyntaxError`` (some broken PNG chunks) and ``DecompressionBombError``."""
    from PIL import Image

    return (OSError, SyntaxError, Image.DecompressionBombError)


def find_classes(split_dir: Path) -> list[str]:
    """Sorted sub-folder names of ``split_dir``. Raises ``FileNotFoundError`` when there are none."""
    if not split_dir.is_dir():
        raise FileNotFoundError(f"image folder split {str(split_dir)!r} does not exist")
    classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise FileNotFoundError(f"{split_dir} has no class sub-folders (expected <split>/<class>/<image>)")
    return classes


class ImageFolder(Dataset):
    """Args:
        split_dir: ``<root>/<split>``.
        classes: class names in label order (take them from the training split).
        transform: the image tokenizer's data-side half (``ImagePreprocess``: ``load`` then ``augment``).
        cache: keep every decoded (resized, not augmented) image in memory after its first read, per
            process — for small datasets, where decoding would otherwise dominate the step time.

    Raises:
        FileNotFoundError: a missing split folder, or one without images.
        DataError: a class folder that is not among ``classes``.
    """

    def __init__(self, split_dir: Path, classes: list[str], transform, cache: bool = False):
        self.split_dir, self.classes, self.transform = Path(split_dir), list(classes), transform
        self.cache: dict[int, torch.Tensor] | None = {} if cache else None
        index = {c: i for i, c in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = []
        for name in find_classes(self.split_dir):
            if name not in index:
                raise DataError(
                    f"{self.split_dir / name}: class {name!r} is not among the training classes "
                    f"{self.classes}"
                )
            folder = self.split_dir / name
            files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
            self.samples += [(str(p), index[name]) for p in files]
        if not self.samples:
            raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {self.split_dir}")

    def __len__(self) -> int:
        return len(self.samples)

    def decode(self, i: int):
        """The PIL image of sample ``i``, fully read; raises one of ``_decode_errors()`` when unreadable."""
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
        errors = _decode_errors()
        bad: list[str] = []
        for attempt in range(MAX_CONSECUTIVE_BAD):
            j = (i + attempt) % len(self.samples)
            try:
                pixels = self.pixels(j)
            except errors as e:
                path = self.samples[j][0]
                log.warning("unreadable image skipped: %s (%s: %s)", path, type(e).__name__, e)
                bad.append(path)
                continue
            return {"image": self.transform.augment(pixels), "label": self.samples[j][1], "bad_samples": bad}
        raise DataError(
            f"{MAX_CONSECUTIVE_BAD} consecutive unreadable images from {self.samples[i][0]} on "
            "(each is named in a warning above)"
        )


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
