"""Builders of image-classification ``TaskData``: image folders (users' own data, bundled
datasets) and CIFAR-10's python format (torchvision, with its real download path)."""

from __future__ import annotations

from ..tokenizers.image import ImagePreprocess
from .collate import collate_classification
from .crop_flip import RandomCropFlip
from .datamodule import TaskData
from .folders import find_classes, split_folder
from .image_folder import ImageFolder, TorchvisionClassification
from .roots import DataError, DataNotFoundError, data_root, resolve_root


def _augment(cfg, image_size: int) -> list:
    """``crop_padding`` / ``hflip``: torchvision's ``RandomCrop(image_size, padding)`` then
    ``RandomHorizontalFlip()``, as ``RandomCropFlip`` computes them (the same draws and pixels, in a few
    tensor operations)."""
    if cfg.crop_padding == 0 and not cfg.hflip:
        return []
    return [RandomCropFlip(image_size, cfg.crop_padding, 0.5 if cfg.hflip else 0.0)]


def image_preprocess(cfg, tok) -> tuple[ImagePreprocess, ImagePreprocess]:
    train = ImagePreprocess(tok.image_size, tok.in_chans, _augment(cfg, tok.image_size))
    val = ImagePreprocess(tok.image_size, tok.in_chans)
    return train, val


def image_folder_data(cfg, tok, num_classes: int | None = None) -> TaskData:
    """``cfg``: ``ImageFolderDataConfig``; ``tok``: the image tokenizer's config (size, channels, mean/std).

    Raises:
        DataNotFoundError: a missing root.
        DataError: a missing split (the message shows the layout), a class folder without images, a
            number of class folders other than the head's ``num_classes``.
    """
    root = resolve_root(cfg.root)
    train_dir = split_folder(root, cfg, "train_split", "image")
    val_dir = split_folder(root, cfg, "val_split", "image")
    classes = find_classes(train_dir)
    if num_classes is not None and len(classes) != num_classes:
        shown = ", ".join(classes[:12]) + (", …" if len(classes) > 12 else "")
        raise DataError(
            f"{root / cfg.train_split} has {len(classes)} class folders ({shown}) but the head "
            f"has num_classes={num_classes}"
        )
    train_tf, val_tf = image_preprocess(cfg, tok)
    train = ImageFolder(train_dir, classes, train_tf, cfg.cache)
    val = ImageFolder(val_dir, classes, val_tf, cfg.cache)
    return TaskData(
        train=train,
        val=val,
        train_sources=[p for p, _ in train.samples],
        val_sources=[p for p, _ in val.samples],
        collate=collate_classification,
        batch_size=cfg.batch_size,
        val_batch_size=cfg.val_batch_size or cfg.batch_size,
        num_workers=cfg.num_workers,
        drop_last=cfg.drop_last,
    )


def cifar10_data(cfg, tok, num_classes: int | None = None) -> TaskData:
    """CIFAR-10 (Krizhevsky 2009) in its python format under ``root``; ``download: true`` fetches it
    from the official URL through torchvision (needs internet)."""
    from pathlib import Path

    from torchvision.datasets import CIFAR10

    root = (
        Path(cfg.root) if Path(cfg.root).is_absolute() or Path(cfg.root).exists() else data_root() / cfg.root
    )
    if not cfg.download and not (root / "cifar-10-batches-py").is_dir():
        raise DataNotFoundError(
            f"CIFAR-10 not found at {root / 'cifar-10-batches-py'}; set data.download=true "
            "to fetch it (needs internet) or point data.root at an extracted copy"
        )
    if num_classes is not None and num_classes != 10:
        raise DataError(f"CIFAR-10 has 10 classes but the head has num_classes={num_classes}")
    train_tf, val_tf = image_preprocess(cfg, tok)
    return TaskData(
        train=TorchvisionClassification(CIFAR10(str(root), train=True, download=cfg.download), train_tf),
        val=TorchvisionClassification(CIFAR10(str(root), train=False, download=cfg.download), val_tf),
        collate=collate_classification,
        batch_size=cfg.batch_size,
        val_batch_size=cfg.val_batch_size or cfg.batch_size,
        num_workers=cfg.num_workers,
        drop_last=cfg.drop_last,
    )
