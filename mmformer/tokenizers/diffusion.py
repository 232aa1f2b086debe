"""Diffusion input: a noisy image, its timestep and its condition → Tokens with a conditioning vector
(Peebles & Xie 2023, "Scalable Diffusion Models with Transformers" (DiT), §3.2; names as the reference
implementation facebookresearch/DiT ``models.py``: ``x_embedder``, ``t_embedder``, ``y_embedder``,
``pos_embed``).

The tokenizer returns ``ConditionedTokens`` (Tokens + ``cond (B, D)``); the model hands ``cond`` to the
backbone, which reads it through its ``AdaLNBlock``s (``cond=``), and to the ``DiTFinalLayer`` head,
which turns the hidden states back into an image.

Shape legend: B batch, C channels, H×W pixels, p patch size, Gh×Gw patch grid, N = Gh·Gw tokens, D width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..nn.tokens import MODALITY_IDS, ConditionedTokens, Tokens
from .image import PatchEmbed


def sincos_pos_embed_2d(d_model: int, grid_size: tuple[int, int]) -> Tensor:
    """Fixed 2-D sin-cos position embedding ``(Gh·Gw, D)`` float32, row-major over the grid: the first
    half of the channels encodes the row, the second the column, each as ``[sin, cos]`` with
    ``ω_i = 10000^(-i / (D/4))`` (MAE / DiT ``get_2d_sincos_pos_embed``). Raises ``ValueError`` unless
    ``D`` is a multiple of 4."""
    if d_model % 4:
        raise ValueError(f"2-D sin-cos positions need d_model divisible by 4, got {d_model}")
    omega = 1.0 / 10_000 ** (torch.arange(d_model // 4, dtype=torch.float64) / (d_model / 4))
    rows, cols = torch.meshgrid(
        torch.arange(grid_size[0], dtype=torch.float64),
        torch.arange(grid_size[1], dtype=torch.float64),
        indexing="ij",
    )

    def embed(pos: Tensor) -> Tensor:
        angles = pos.reshape(-1, 1) * omega  # (N, D/4)
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    # DiT's grid is (w, h) = meshgrid(cols, rows): the first half embeds the column index
    return torch.cat([embed(cols), embed(rows)], dim=1).float()


class TimestepEmbedder(nn.Module):
    """Timesteps → vectors: ``[cos(t·ω), sin(t·ω)]`` over ``freq_dim`` frequencies
    (``ω_i = max_period^(-i / (freq_dim/2))``) → Linear → SiLU → Linear (DiT ``TimestepEmbedder``).

    Args:
        d_model: output width.
        freq_dim: sinusoid features (256 in DiT).
    Integer DDPM steps in [0, 1000) go in as they are; rectified-flow times t ∈ [0, 1] go in as 1000·t
    (``DiffusionTask`` scales them), so both spread over the same frequencies.

    ``forward(t (B,) int or float) → (B, D)`` float.
    """

    def __init__(self, d_model: int, freq_dim: int = 256, max_period: float = 10_000):
        super().__init__()
        self.freq_dim, self.max_period = freq_dim, max_period
        self.mlp = nn.Sequential(nn.Linear(freq_dim, d_model), nn.SiLU(), nn.Linear(d_model, d_model))
        for layer in (self.mlp[0], self.mlp[2]):
            nn.init.normal_(layer.weight, std=0.02)  # DiT initialize_weights
            nn.init.zeros_(layer.bias)

    def frequencies(self, t: Tensor) -> Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(self.max_period) * torch.arange(half, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t: Tensor) -> Tensor:
        return self.mlp(self.frequencies(t).to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class labels → vectors, with one extra row, id ``num_classes``, for the null (unconditional)
    class of classifier-free guidance (DiT ``LabelEmbedder``).

    In training mode each label is replaced by the null class with probability ``dropout``
    (Ho & Salimans 2022, §3.2); ``force_drop (B,) bool`` drops chosen labels in any mode.
    ``forward(labels (B,) long) → (B, D)``. Raises ``ValueError`` for labels outside ``[0, num_classes]``.
    """

    def __init__(self, num_classes: int, d_model: int, dropout: float = 0.1):
        super().__init__()
        self.num_classes, self.dropout = num_classes, dropout
        self.embedding_table = nn.Embedding(num_classes + 1, d_model)
        nn.init.normal_(self.embedding_table.weight, std=0.02)

    @property
    def null_class(self) -> int:
        return self.num_classes

    def drop(self, labels: Tensor, force_drop: Tensor | None = None) -> Tensor:
        """Labels with the dropped ones replaced by ``null_class``."""
        drop = torch.zeros_like(labels, dtype=torch.bool)
        if self.training and self.dropout > 0:
            drop = torch.rand(labels.shape, device=labels.device) < self.dropout
        if force_drop is not None:
            drop = drop | force_drop
        return torch.where(drop, torch.full_like(labels, self.null_class), labels)

    def forward(self, labels: Tensor, force_drop: Tensor | None = None) -> Tensor:
        # checked where it costs no device sync (the data pipeline's labels arrive on the CPU in tests and
        # CPU runs; on accelerators an out-of-range id fails in the embedding lookup)
        if (
            labels.device.type == "cpu"
            and labels.numel()
            and (labels.min() < 0 or labels.max() > self.num_classes)
        ):
            raise ValueError(f"class labels must be in [0, {self.num_classes}] ({self.num_classes} = null)")
        return self.embedding_table(self.drop(labels, force_drop))


class TextConditionEmbedder(nn.Module):
    """A pooled caption ``(B, D)`` (the text tokenizer's embeddings, mean over real tokens) → the
    conditioning vector through Linear → SiLU → Linear; a learned ``null`` vector stands for "no
    caption" (classifier-free guidance), chosen in training with probability ``dropout`` and wherever
    ``force_drop`` is True (GLIDE, Nichol et al. 2022, §2.4: guidance with an empty caption).

    ``forward(pooled (B, D), force_drop (B,) bool | None) → (B, D)``."""

    def __init__(self, d_model: int, dropout: float = 0.1):
        super().__init__()
        self.dropout = dropout
        self.mlp = nn.Sequential(nn.Linear(d_model, d_model), nn.SiLU(), nn.Linear(d_model, d_model))
        self.null = nn.Parameter(torch.zeros(d_model))
        for layer in (self.mlp[0], self.mlp[2]):
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)

    def forward(self, pooled: Tensor, force_drop: Tensor | None = None) -> Tensor:
        drop = torch.zeros(pooled.shape[0], dtype=torch.bool, device=pooled.device)
        if self.training and self.dropout > 0:
            drop = torch.rand(pooled.shape[0], device=pooled.device) < self.dropout
        if force_drop is not None:
            drop = drop | force_drop
        out = self.mlp(pooled.to(self.null.dtype))
        return torch.where(drop[:, None], self.null.expand_as(out), out)


class DiTTokenizer(nn.Module):
    """Noisy image, timestep and class → ``ConditionedTokens`` (Tokens + ``cond``).

    Args:
        d_model: token and conditioning width ``D``.
        image_size, patch_size, in_chans: the image ``(C, H, W)`` with ``H = W = image_size``, cut into
            ``patch_size`` patches.
        num_classes: class-conditional with a null class for guidance; ``None`` = unconditional.
        class_dropout: the probability a training label (or caption) becomes the null one.
        text_conditional: condition on a pooled caption ``text (B, D)`` (``TextConditionEmbedder``).

    ``forward(x_t (B, C, H, W) float, t (B,), labels (B,) long | None, force_drop (B,) bool | None,
    text (B, D) | None) → ConditionedTokens``: ``x`` is the patch embedding plus fixed 2-D sin-cos
    positions, ``positions (B, N, 2)`` are (row, column); ``cond (B, D)`` = timestep embedding + label
    embedding + caption embedding (those the model has).
    Raises ``ValueError`` on a wrong image shape or a missing/unexpected label.
    """

    modality = "diffusion"
    num_prefix_tokens = 0

    def __init__(
        self,
        d_model: int,
        image_size: int,
        patch_size: int,
        in_chans: int,
        num_classes: int | None = None,
        class_dropout: float = 0.1,
        text_conditional: bool = False,
    ):
        super().__init__()
        self.image_size, self.patch_size, self.in_chans = image_size, patch_size, in_chans
        self.x_embedder = PatchEmbed(image_size, patch_size, in_chans, d_model)
        self.register_buffer(
            "pos_embed", sincos_pos_embed_2d(d_model, self.x_embedder.grid_size)[None], persistent=False
        )
        self.t_embedder = TimestepEmbedder(d_model)
        self.y_embedder = LabelEmbedder(num_classes, d_model, class_dropout) if num_classes else None
        self.text_embedder = TextConditionEmbedder(d_model, class_dropout) if text_conditional else None
        # DiT: patch embedding initialised like a linear layer (xavier on the flattened kernel)
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.x_embedder.grid_size

    @property
    def num_classes(self) -> int | None:
        return self.y_embedder.num_classes if self.y_embedder is not None else None

    def example_input(self, batch_size: int = 1) -> Tensor:
        return torch.zeros(batch_size, self.in_chans, self.image_size, self.image_size)

    def forward(
        self,
        x_t: Tensor,
        t: Tensor | None = None,
        labels: Tensor | None = None,
        force_drop: Tensor | None = None,
        text: Tensor | None = None,
    ) -> ConditionedTokens:
        expected = (self.in_chans, self.image_size, self.image_size)
        if x_t.ndim != 4 or tuple(x_t.shape[1:]) != expected:
            raise ValueError(
                f"expected noisy images (B, {', '.join(map(str, expected))}), got {tuple(x_t.shape)}"
            )
        B = x_t.shape[0]
        if t is None:  # shape-only uses (FLOP counting, `mmformer info`)
            t = torch.zeros(B, device=x_t.device)
        x_t = x_t.to(self.x_embedder.proj.weight.dtype)  # float32 noise into bf16 weights (bf16-true)
        x = self.x_embedder(x_t) + self.pos_embed.to(x_t.dtype)
        cond = self.t_embedder(t)
        if self.y_embedder is not None:
            if labels is None:  # unconditional use of a conditional model: the null class, explicitly
                labels = torch.full((B,), self.y_embedder.null_class, device=x_t.device, dtype=torch.long)
            cond = cond + self.y_embedder(labels, force_drop)
        elif labels is not None:
            raise ValueError("this diffusion tokenizer is unconditional (num_classes is None) but got labels")
        if self.text_embedder is not None:
            if text is None:  # no caption: the null caption
                text = x.new_zeros(B, x.shape[-1])
                force_drop = torch.ones(B, dtype=torch.bool, device=x.device)
            cond = cond + self.text_embedder(text, force_drop)
        elif text is not None:
            raise ValueError(
                "this diffusion tokenizer is not text-conditional (text_conditional: false) but got text"
            )
        Gh, Gw = self.grid_size
        rows, cols = torch.meshgrid(
            torch.arange(Gh, device=x.device), torch.arange(Gw, device=x.device), indexing="ij"
        )
        positions = torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1).expand(B, -1, -1)
        tokens = Tokens.from_embeddings(x, MODALITY_IDS["diffusion"], positions=positions)
        return ConditionedTokens.of(tokens, cond)
