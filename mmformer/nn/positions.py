"""Position encodings.

* ``sinusoidal`` — fixed sin/cos features (Vaswani et al. 2017, arXiv:1706.03762 §3.5).
* ``resample_pos_embed`` — learned absolute embeddings resampled to a new length or 2-D grid
  (timm's ``resample_abs_pos_embed``: bicubic over the grid, prefix tokens kept).
* ``RotaryEmbedding`` — RoPE (Su et al. 2021, arXiv:2104.09864) in the "rotate half" layout of
  GPT-NeoX / HF Llama; 1-D, or multimodal over several position axes (Qwen2-VL's M-RoPE: the
  frequencies are split into one section per axis; (row, column) for patch grids). Angles are
  computed in float32 whatever the model dtype, so positions in the thousands stay exact in bf16.
* ``alibi_slopes`` / ``alibi_bias`` — ALiBi (Press et al. 2022, arXiv:2108.12409 §3), slopes for any
  head count as in the reference implementation (closest power of two, then interleaved extras).
* ``RelativePositionBias`` — a learned per-head scalar added to the attention scores, a function of the
  key's offset from the query only (a Toeplitz matrix): T5's log-spaced buckets (Raffel et al. 2020,
  §2.1; ``t5_relative_bucket`` equals HF ``T5Attention._relative_position_bucket``), or one value per
  clipped offset (Shaw et al. 2018's clipping, as a scalar bias).

Shape legend: B batch, N tokens, P position axes, H heads, Dh head width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal(positions: Tensor, dim: int, base: float = 10_000.0) -> Tensor:
    """``positions (...)`` (any numeric dtype, may be fractional) → ``(..., dim)`` float32 features:
    ``[sin(p·ω_0), …, sin(p·ω_{d/2-1}), cos(p·ω_0), …]`` with ``ω_i = base^(-2i/dim)``.

    Raises ``ValueError`` for an odd ``dim``.
    """
    if dim % 2:
        raise ValueError(f"sinusoidal features need an even dim, got {dim}")
    freqs = base ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
    angles = positions.float().unsqueeze(-1) * freqs  # (..., dim/2)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def resample_pos_embed(
    pos_embed: Tensor,
    new_size: int | tuple[int, int],
    num_prefix_tokens: int = 0,
    old_size: int | tuple[int, int] | None = None,
) -> Tensor:
    """Resample learned absolute position embeddings ``(1, prefix + L, D)`` to a new length ``L'`` (int)
    or a new 2-D grid ``(H', W')`` (tuple), keeping the prefix (class token) embeddings unchanged.

    1-D: linear interpolation; 2-D: bicubic over the grid via timm's ``resample_abs_pos_embed`` (the
    reference behaviour for ViT checkpoints). Raises ``ValueError`` when the old grid is not given and
    the length is not a square.
    """
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    if isinstance(new_size, int):  # 1-D sequence
        out = (
            nn.functional.interpolate(
                grid.transpose(1, 2).float(), size=new_size, mode="linear", align_corners=False
            )
            .transpose(1, 2)
            .to(pos_embed.dtype)
        )
        return torch.cat([prefix, out], dim=1)
    if old_size is None:
        side = math.isqrt(grid.shape[1])
        if side * side != grid.shape[1]:
            raise ValueError(f"cannot infer the grid of {grid.shape[1]} position embeddings; pass old_size")
        old_size = (side, side)
    from timm.layers import resample_abs_pos_embed  # lazily: importing timm imports wandb

    return resample_abs_pos_embed(
        pos_embed, list(new_size), list(old_size), num_prefix_tokens=num_prefix_tokens, verbose=False
    )


class RotaryEmbedding(nn.Module):
    """RoPE angles for ``positions (B, N, P)``; ``apply`` rotates queries and keys.

    Frequencies ``θ^(-2i/Dh)`` span the whole head; with several axes they are split into contiguous
    sections and section ``a`` rotates by position axis ``a`` (Qwen2-VL's multimodal RoPE, arXiv:2409.12191
    §2.1). A token whose 1-D index is repeated on every axis (text) therefore gets exactly 1-D RoPE, and
    Llama-style weights keep working when image grids join the sequence.

    Args:
        head_dim: ``Dh`` (even).
        base: frequency base θ (10,000 in the paper; Llama 3 uses 500,000).
        n_axes: 1 for sequences; 2 for (row, column) patch grids; at most ``P`` of the positions.
        sections: frequencies per axis (sum ``Dh / 2``); default: as equal as possible, earlier axes
            taking the remainder.

    Raises ``ValueError`` for an odd ``head_dim`` or sections that do not sum to ``Dh / 2``.
    The angles are always computed in float32 (no buffer a ``.to(bfloat16)`` could round).
    """

    def __init__(
        self, head_dim: int, base: float = 10_000.0, n_axes: int = 1, sections: list[int] | None = None
    ):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        half = head_dim // 2
        if sections is None:
            sections = [half // n_axes + (1 if a < half % n_axes else 0) for a in range(n_axes)]
        if len(sections) != n_axes or sum(sections) != half:
            raise ValueError(
                f"RoPE sections {sections} must be {n_axes} numbers summing to head_dim/2 = {half}"
            )
        self.head_dim, self.base, self.n_axes, self.sections = head_dim, base, n_axes, list(sections)
        self.freq_axis = [
            a for a, n in enumerate(sections) for _ in range(n)
        ]  # (Dh/2,) each frequency's axis

    def inv_freq(self, device=None) -> Tensor:
        """``(Dh/2,)`` float32 frequencies ``θ^(-2i/Dh)``."""
        return self.base ** (
            -torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        )

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``positions (B, N, P)`` → ``(cos, sin)``, each ``(B, 1, N, Dh)`` float32."""
        if positions.shape[-1] < self.n_axes:
            raise ValueError(
                f"RoPE over {self.n_axes} axes needs positions (B, N, >= {self.n_axes}), "
                f"got {tuple(positions.shape)}"
            )
        # the axis index from Python ints (a repeat_interleave by a tensor of counts has a data-dependent
        # size: a graph break in every compiled step)
        axis = torch.tensor(self.freq_axis, device=positions.device)
        pos = positions.float().index_select(-1, axis)  # (B, N, Dh/2): each frequency's axis position
        half = pos * self.inv_freq(positions.device)
        emb = torch.cat([half, half], dim=-1).unsqueeze(1)  # (B, 1, N, Dh), rotate-half layout
        return emb.cos(), emb.sin()

    @staticmethod
    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate ``x (B, H, N, Dh)`` by the angles; computed in float32, returned in ``x.dtype``."""
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi head slopes ``(H,)``: a geometric sequence ``2^(-8/n)·k`` for the closest power of two
    ``n ≤ H``, then every other slope of the sequence for ``2n`` heads for the remaining heads
    (Press et al., reference implementation ``get_slopes``)."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Additive ALiBi bias ``-slope_h · |pos_q - pos_k|``: ``slopes (H,)``, ``q_pos (B, Nq)``,
    ``k_pos (B, Nk)`` → ``(B, H, Nq, Nk)`` float32. (Causal models only ever see ``pos_q ≥ pos_k``.)"""
    dist = (q_pos[:, None, :, None] - k_pos[:, None, None, :]).abs().float()
    return -slopes.float().view(1, -1, 1, 1).to(dist.device) * dist


def t5_relative_bucket(
    relative_position: Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """T5's bucket of ``relative_position = key position - query position`` (long, any shape): half the
    buckets (all of them when not ``bidirectional``) hold exact small offsets, the rest log-spaced offsets
    up to ``max_distance``; farther offsets share the last bucket. Bidirectional: keys after the query
    use the upper half. Exactly HF transformers' ``T5Attention._relative_position_bucket``."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        n = relative_position.abs()
    else:
        n = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = (
        max_exact
        + (
            torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
        ).long()
    )
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, n, large)


class RelativePositionBias(nn.Module):
    """Learned relative position bias, shared by every layer (T5 computes it once, in the first layer).

    Args:
        n_heads: ``H``.
        kind: ``t5`` (log buckets, ``num_buckets`` and ``max_distance``) or ``toeplitz`` (one value per
            offset in ``[-max_distance, max_distance]``, farther offsets clipped).
        bidirectional: keys after the query get their own buckets (encoders); False for causal models.

    ``buckets(q_pos (B, Nq), k_pos (B, Nk)) → (B, Nq, Nk)`` long; ``forward`` → the additive bias
    ``(B, H, Nq, Nk)`` float32 (``table[bucket, h]``). Raises ``ValueError`` for an unknown kind.
    """

    KINDS = ("t5", "toeplitz")

    def __init__(
        self,
        n_heads: int,
        kind: str = "t5",
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
    ):
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(f"unknown relative bias {kind!r}; choose from {self.KINDS}")
        self.kind, self.num_buckets, self.max_distance, self.bidirectional = (
            kind,
            num_buckets,
            max_distance,
            bidirectional,
        )
        size = num_buckets if kind == "t5" else 2 * max_distance + 1
        self.table = nn.Parameter(torch.zeros(size, n_heads))  # (buckets, H)

    def init_weights(self) -> None:
        nn.init.normal_(self.table, std=0.02)

    def buckets(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        rel = k_pos[:, None, :].long() - q_pos[:, :, None].long()  # (B, Nq, Nk): key minus query
        if self.kind == "t5":
            return t5_relative_bucket(rel, self.bidirectional, self.num_buckets, self.max_distance)
        return rel.clamp(-self.max_distance, self.max_distance) + self.max_distance

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return self.table.float()[self.buckets(q_pos, k_pos)].permute(0, 3, 1, 2)
