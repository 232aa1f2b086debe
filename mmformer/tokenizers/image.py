"""Image tokenizer: ViT patches (Dosovitskiy et al. 2020, arXiv:2010.11929, §3.1).

Two halves (DESIGN.md):
  * data side — ``ImagePreprocess``: PIL image → ``uint8`` tensor ``(C, H, W)`` (resize, augmentation),
    per sample, in data-loader workers (torchvision transforms);
  * model side — ``ViTPatchTokenizer``: pixels ``(B, C, H, W)`` → ``Tokens`` on the accelerator:
    scaling to [0, 1] and mean/std normalisation of ``uint8`` pixels (as timm's prefetcher does on
    the device: batches stay 4× smaller and workers do less), conv patch embedding, optional class
    token, learned absolute position embedding.

Parameter names match timm's ``VisionTransformer`` (``patch_embed.proj``, ``cls_token``,
``pos_embed``), so a timm checkpoint maps onto this module by prefix alone.

Shape legend: B batch, C channels, H×W pixels, p patch size, Gh×Gw patch grid, N tokens, D width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn.tokens import MODALITY_IDS, Tokens

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def image_hw(image_size: int | tuple[int, int]) -> tuple[int, int]:
    """``(height, width)`` of a square side or an ``(H, W)`` pair."""
    if isinstance(image_size, int):
        return image_size, image_size
    h, w = image_size
    return int(h), int(w)


class PatchEmbed(nn.Module):
    """Non-overlapping ``patch_size`` patches through one strided conv (timm ``PatchEmbed``);
    ``image_size`` is a square side or ``(H, W)``."""

    def __init__(self, image_size: int | tuple[int, int], patch_size: int, in_chans: int, d_model: int):
        super().__init__()
        h, w = image_hw(image_size)
        if h % patch_size or w % patch_size:
            raise ValueError(f"image_size={image_size} is not divisible by patch_size={patch_size}")
        self.image_size, self.patch_size = (h, w), patch_size
        self.grid_size = (h // patch_size, w // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, d_model, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, D, Gh, Gw) → (B, Gh·Gw, D)


class ViTPatchTokenizer(nn.Module):
    """Pixels → Tokens: ``[cls] + patches``, each plus its learned position embedding.

    Args:
        d_model: token width ``D`` (the backbone's).
        image_size: input side in pixels, or ``(H, W)`` for non-square images.
        patch_size: patch side in pixels; must divide ``image_size``.
        in_chans: input channels ``C`` (1 grayscale, 3 RGB).
        class_token: prepend a learned ``cls_token`` (its position embedding is ``pos_embed[:, 0]``,
            as timm's default ``no_embed_class=False``).
        mean, std: per-channel normalisation applied here to ``uint8`` pixels (after scaling to [0, 1]).

    ``forward(pixels (B, C, H, W)) → Tokens``. ``uint8`` pixels (0–255, what ``ImagePreprocess`` and
    image files give) are scaled to [0, 1] and normalised with ``mean``/``std`` here; floating-point
    pixels are taken as already normalised. ``x (B, N, D)``, ``N = class_token + Gh·Gw``,
    positions ``(B, N, 2)``: (row, column) of each patch, the class token at (0, 0) — the 2-D axes
    that relative schemes (2-D RoPE) read. Raises ``ValueError`` on a wrong input shape.
    """

    modality = "image"

    def __init__(
        self,
        d_model: int,
        image_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        class_token: bool = True,
        mean: tuple[float, ...] = IMAGENET_MEAN,
        std: tuple[float, ...] = IMAGENET_STD,
    ):
        super().__init__()
        self.image_size, self.in_chans = image_size, in_chans
        self.mean, self.std = tuple(mean), tuple(std)
        self.patch_embed = PatchEmbed(image_size, patch_size, in_chans, d_model)
        self.num_prefix_tokens = 1 if class_token else 0
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model)) if class_token else None
        n = self.num_prefix_tokens + self.patch_embed.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, n, d_model))
        gh, gw = self.patch_embed.grid_size
        rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        grid = torch.stack([rows.flatten(), cols.flatten()], dim=-1)  # (Gh·Gw, 2)
        prefix = torch.zeros(self.num_prefix_tokens, 2, dtype=torch.long)
        self.register_buffer("grid_positions", torch.cat([prefix, grid]), persistent=False)
        self.register_buffer("pixel_mean", torch.tensor(self.mean).view(1, -1, 1, 1) * 255, persistent=False)
        self.register_buffer("pixel_std", torch.tensor(self.std).view(1, -1, 1, 1) * 255, persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """timm ViT init: trunc-normal(0.02) position embedding, normal(1e-6) class token,
        conv patch embedding initialised like a linear layer (xavier-uniform of its flattened weight)."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        w = self.patch_embed.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.patch_embed.proj.bias)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}

    def example_input(self, batch_size: int = 1) -> Tensor:
        """Zeros of the expected input shape ``(batch_size, C, H, W)`` (FLOP counting, smoke tests)."""
        return torch.zeros(batch_size, self.in_chans, *self.patch_embed.image_size)

    def forward(self, pixels: Tensor) -> Tokens:
        h, w = self.patch_embed.image_size
        if pixels.dim() != 4 or pixels.shape[1:] != (self.in_chans, h, w):
            raise ValueError(
                f"ViTPatchTokenizer expects pixels (B, {self.in_chans}, {h}, {w}), got {tuple(pixels.shape)}"
            )
        if pixels.dtype == torch.uint8:
            pixels = (pixels.to(self.pixel_mean.dtype) - self.pixel_mean) / self.pixel_std
        x = self.patch_embed(pixels.to(self.patch_embed.proj.weight.dtype))  # (B, Gh·Gw, D)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, N, D)
        x = x + self.pos_embed
        positions = self.grid_positions.unsqueeze(0).expand(x.shape[0], -1, -1)  # (B, N, 2)
        return Tokens.from_embeddings(x, MODALITY_IDS["image"], positions=positions)


class ImagePreprocess:
    """Data-side half: a PIL image → ``(C, H, W)`` ``uint8`` (0–255). Normalisation happens model-side.

    Two steps, so datasets can cache the first: ``load`` (colour mode, resize of the shorter side and
    centre crop when the image is not already ``image_size`` square, tensor conversion; deterministic)
    and ``augment`` (the training transforms, applied to the uint8 tensor; random).

    Args:
        image_size: output side in pixels.
        in_chans: 1 → grayscale ("L"), 3 → RGB.
        train_transforms: optional transforms of the uint8 tensor (augmentation; torchvision v2 ones or any
            callable), applied in order.

    Raises ``ValueError`` for ``in_chans`` other than 1 or 3.
    """

    def __init__(self, image_size: int, in_chans: int, train_transforms=None):
        from torchvision.transforms import v2

        if in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 or 3, got {in_chans}")
        self.mode = "L" if in_chans == 1 else "RGB"
        self.image_size = image_size
        self.resize = v2.Compose([v2.Resize(image_size), v2.CenterCrop(image_size)])
        self.to_tensor = v2.PILToTensor()
        self.train_transforms = list(train_transforms or [])

    def load(self, image) -> Tensor:
        image = image.convert(self.mode)
        if image.size != (self.image_size, self.image_size):
            image = self.resize(image)
        return self.to_tensor(image)  # (C, H, W) uint8

    def augment(self, pixels: Tensor) -> Tensor:
        for transform in self.train_transforms:
            pixels = transform(pixels)
        return pixels

    def __call__(self, image) -> Tensor:
        return self.augment(self.load(image))
