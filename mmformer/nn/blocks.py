"""Transformer blocks. ``Block`` is the pre-norm block of GPT-2 / ViT (timm ``Block`` names:
``norm1``, ``attn``, ``norm2``, ``mlp``); its forward is two residual lines.

Stochastic depth: Huang et al. 2016 (arXiv:1603.09382), as timm's ``DropPath`` (re-implemented here
in a few lines because the model library must not import timm at module level).
Shape legend: B batch, N tokens, D model width.
"""

from __future__ import annotations

from torch import Tensor, nn

from .attention import Attention
from .masks import MaskSpec
from .mlp import Mlp


class DropPath(nn.Module):
    """Drop the whole residual branch per sample with probability ``p`` (training only)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``.

    Args:
        d_model, n_heads, n_kv_heads, qkv_bias, attn_drop, kernel: see ``Attention``.
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        act: MLP activation (``"gelu"`` / ``"relu"``).
        drop: dropout after the attention projection and inside the MLP.
        drop_path: stochastic-depth probability of this block.
        norm_eps: LayerNorm epsilon (timm's ViT uses 1e-6).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        mlp_ratio: float = 4.0,
        n_kv_heads: int | None = None,
        qkv_bias: bool = True,
        act: str = "gelu",
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        norm_eps: float = 1e-6,
        kernel: str = "auto",
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model, eps=norm_eps)
        self.attn = Attention(d_model, n_heads, n_kv_heads, qkv_bias, attn_drop, drop, kernel)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(d_model, eps=norm_eps)
        self.mlp = Mlp(d_model, int(d_model * mlp_ratio), act=act, drop=drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor, mask: MaskSpec | None = None) -> Tensor:
        """``x (B, N, D)`` → ``(B, N, D)``."""
        x = x + self.drop_path1(self.attn(self.norm1(x), mask))
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return x
