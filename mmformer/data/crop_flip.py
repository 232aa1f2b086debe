"""The image-folder training augmentation, random crop with zero padding and a horizontal flip, on one
``uint8`` image tensor in a handful of tensor operations.

It computes exactly what ``v2.Compose([v2.RandomCrop(size, padding=padding), v2.RandomHorizontalFlip()])``
computes, drawing the same numbers from torch's generator in the same order (``torch.randint`` for the
top, then the left offset of the padded image, then ``torch.rand(1)`` for the flip), so a seeded stream
(``seeding.seeded``) gives the same pixels as torchvision's transforms. torchvision pays for its
generality (input flattening and type dispatch, a padded copy of the image before the crop): a training
batch of 128 quickstart digits took 11.6 ms that way against 5.1 ms now (``bench/overhead.py --data-path``).
"""

from __future__ import annotations

import torch
from torch import Tensor


class RandomCropFlip:
    """``(C, H, W)`` → ``(C, size, size)``, same dtype: the image zero-padded by ``padding`` pixels on
    every side, a ``size × size`` window at a uniformly drawn offset, then flipped left-right with
    probability ``flip_p`` (0: never, and no draw is made, as without torchvision's flip transform).

    Raises ``ValueError`` when the padded image is smaller than ``size`` (torchvision's message) or for a
    negative ``padding``.
    """

    def __init__(self, size: int, padding: int = 0, flip_p: float = 0.0):
        if padding < 0:
            raise ValueError(f"padding must be >= 0, got {padding}")
        self.size, self.padding, self.flip_p = size, padding, flip_p

    def __call__(self, pixels: Tensor) -> Tensor:
        p, size = self.padding, self.size
        h, w = pixels.shape[-2:]
        if h + 2 * p < size or w + 2 * p < size:
            padded = (h + 2 * p, w + 2 * p)
            what = "padded input image size" if p else "input image size"
            raise ValueError(f"Required crop size {(size, size)} is larger than {what} {padded}.")
        # offsets in the padded image, drawn as torchvision's RandomCrop.make_params draws them
        top = int(torch.randint(0, h + 2 * p - size + 1, size=())) if h + 2 * p > size else 0
        left = int(torch.randint(0, w + 2 * p - size + 1, size=())) if w + 2 * p > size else 0
        flip = self.flip_p > 0 and bool(torch.rand(1) < self.flip_p)
        # the window [top, top + size) of the padded image covers rows [top - p, top - p + size) of the image
        r0, c0 = top - p, left - p
        rows = slice(min(max(r0, 0), h), min(max(r0 + size, 0), h))  # empty when the window is all padding
        cols = slice(min(max(c0, 0), w), min(max(c0 + size, 0), w))
        src = pixels[..., rows, cols]
        if src.shape[-2:] == (size, size):
            out = src.clone()
        else:
            out = pixels.new_zeros(*pixels.shape[:-2], size, size)
            out[..., max(-r0, 0) : max(-r0, 0) + src.shape[-2], max(-c0, 0) : max(-c0, 0) + src.shape[-1]] = (
                src
            )
        return out.flip(-1) if flip else out

    def __repr__(self) -> str:
        return f"RandomCropFlip(size={self.size}, padding={self.padding}, flip_p={self.flip_p})"
