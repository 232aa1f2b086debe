"""Multi-head self-attention with one fused ``qkv`` projection and switchable kernels.

Kernels:
  * ``eager`` — the readable reference: ``softmax(q kᵀ / √d + mask) v`` written out. Every fused
    kernel is tested against it, and it is the path on which FLOPs can be counted on CPU.
  * ``sdpa`` — ``F.scaled_dot_product_attention`` (FlashAttention / memory-efficient / cuDNN on GPU).
  * ``auto`` — the fastest correct kernel; for the masks built here (padding, causal, documents) that
    is ``sdpa`` on every device, with and without gradients.

Parameter names follow timm's ``Attention`` (``qkv``, ``proj``) so ViT checkpoints map by prefix.
Reference: Vaswani et al. 2017 (arXiv:1706.03762) §3.2; GQA: Ainslie et al. 2023 (arXiv:2305.13245).

Shape legend: B batch, N tokens, D model width, H query heads, Hkv key/value heads, Dh head width.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .masks import MaskSpec

KERNELS = ("auto", "eager", "sdpa")


def eager_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float = 0.0) -> Tensor:
    """Reference attention. ``q (B, H, N, Dh)``, ``k, v (B, H, M, Dh)``, ``mask`` bool broadcastable to
    ``(B, H, N, M)`` with True = may attend. Fully masked query rows return zeros."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, N, M)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    attn = scores.float().softmax(dim=-1).nan_to_num(0.0).to(q.dtype)  # fully masked row → 0
    if dropout_p > 0.0:
        attn = F.dropout(attn, p=dropout_p)
    return attn @ v  # (B, H, N, Dh)


class Attention(nn.Module):
    """Self-attention over Tokens.

    Args:
        d_model: width ``D``; must be divisible by ``n_heads``.
        n_heads: query heads ``H``.
        n_kv_heads: key/value heads (``None`` → ``n_heads``; 1 = multi-query). Must divide ``n_heads``.
        qkv_bias: bias on the fused ``qkv`` projection.
        attn_drop: dropout on attention weights (training only).
        proj_drop: dropout after the output projection.
        kernel: one of ``KERNELS``; can be changed later through the ``kernel`` attribute.

    Raises:
        ValueError: on indivisible widths / head counts or an unknown kernel.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        kernel: str = "auto",
    ):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.kernel = kernel
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=qkv_bias)
        self.proj = nn.Linear(n_heads * self.head_dim, d_model)
        self.proj_drop = nn.Dropout(proj_drop)

    @property
    def kernel(self) -> str:
        return self._kernel

    @kernel.setter
    def kernel(self, kernel: str) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose from {KERNELS}")
        self._kernel = kernel

    def forward(self, x: Tensor, mask: MaskSpec | None = None) -> Tensor:
        """``x (B, N, D)`` → ``(B, N, D)``; ``mask`` describes who may attend to whom."""
        B, N, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv(x).view(B, N, H + 2 * Hkv, Dh).transpose(1, 2)  # (B, H + 2·Hkv, N, Dh)
        q, k, v = qkv.split([H, Hkv, Hkv], dim=1)
        if Hkv != H:  # GQA: every group of H / Hkv query heads shares one key/value head
            k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))  # (B, H, N, Dh)
        mask = mask or MaskSpec()
        dense = None if mask.is_full or mask.is_causal_only else mask.dense(N, x.device)
        dropout_p = self.attn_drop if self.training else 0.0
        if self.kernel == "eager":
            if mask.is_causal_only:
                dense = mask.dense(N, x.device)
            out = eager_attention(q, k, v, dense, dropout_p)
        else:  # sdpa (and auto)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=dense, dropout_p=dropout_p, is_causal=mask.is_causal_only
            )
            if dense is not None:  # sdpa's fully masked rows are backend-dependent: make them zeros
                out = out.masked_fill(~dense.any(dim=-1, keepdim=True), 0.0)
        out = out.transpose(1, 2).reshape(B, N, H * Dh)  # (B, N, D)
        return self.proj_drop(self.proj(out))
