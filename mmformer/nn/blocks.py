"""The block family. Every block is built from one ``Attention`` and one MLP (made by the caller) and
its forward is a few residual lines; variants are separate small classes, not flags.

* ``Block`` — pre-norm (GPT-2, ViT; timm ``Block`` names ``norm1``, ``attn``, ``norm2``, ``mlp``,
  ``ls1``, ``ls2``).
* ``PostNormBlock`` — post-norm (original Transformer, BERT): the norm follows each residual sum.
* ``CrossAttentionBlock`` — pre-norm decoder block with cross-attention to a context (Whisper's
  decoder, encoder–decoder models): self-attention, cross-attention, MLP.
* ``AdaLNBlock`` — DiT's adaLN-Zero block (Peebles & Xie 2023, arXiv:2212.09748 §3.2): shift, scale
  and gate of both branches regressed from the conditioning vector, zero-initialised so that every
  block starts as the identity.

Stochastic depth: Huang et al. 2016 (arXiv:1603.09382), as timm's ``DropPath`` (written here in a few
lines because the model library must not import timm at module level). Layer scale: Touvron et al.
2021 (CaiT, arXiv:2103.17239), timm's ``LayerScale``.

Shape legend: B batch, N tokens, D model width, M context tokens, Dc conditioning width.
All forwards: ``x (B, N, D)`` → ``(B, N, D)``. The pre- and post-norm blocks (``takes_rows``) also take
``rows``, a slice of the token axis: only those rows are computed past the attention's keys and values,
``(B, len(rows), D)``, equal to the full forward's rows (``Attention.forward(rows=…)``; a classifier's last
block needs its class token only).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import Attention, AttentionInputs, KVCache
from .norms import build_norm


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


class LayerScale(nn.Module):
    """Per-channel learnable scale of a residual branch, initialised to ``init`` (``gamma``, as timm)."""

    def __init__(self, dim: int, init: float = 1e-5):
        super().__init__()
        self.init = init
        self.gamma = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


def _rows(x: Tensor, rows: slice | None) -> Tensor:
    return x if rows is None else x[:, rows]


def _branch_tail(d_model: int, drop_path: float, layer_scale: float | None) -> tuple[nn.Module, nn.Module]:
    ls = LayerScale(d_model, layer_scale) if layer_scale else nn.Identity()
    dp = DropPath(drop_path) if drop_path > 0 else nn.Identity()
    return ls, dp


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``.

    Args:
        d_model: width ``D``.
        attn: a self-attention ``Attention``.
        mlp: the feed-forward module (``Mlp`` / ``SwiGLU``).
        norm: ``layernorm`` or ``rmsnorm``; ``norm_eps`` its epsilon.
        drop_path: stochastic-depth probability of this block.
        layer_scale: initial value of per-channel residual scales, or None for none.
    """

    takes_rows = True  # forward(rows=…) computes only those rows (the module docstring)

    def __init__(
        self,
        d_model: int,
        attn: Attention,
        mlp: nn.Module,
        norm: str = "layernorm",
        norm_eps: float = 1e-6,
        drop_path: float = 0.0,
        layer_scale: float | None = None,
    ):
        super().__init__()
        self.norm1, self.attn = build_norm(norm, d_model, norm_eps), attn
        self.ls1, self.drop_path1 = _branch_tail(d_model, drop_path, layer_scale)
        self.norm2, self.mlp = build_norm(norm, d_model, norm_eps), mlp
        self.ls2, self.drop_path2 = _branch_tail(d_model, drop_path, layer_scale)

    def forward(
        self,
        x: Tensor,
        inputs: AttentionInputs | None = None,
        *,
        context: Tensor | None = None,
        cond: Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
        rows: slice | None = None,
    ) -> Tensor:
        h = self.attn(self.norm1(x), inputs, cache=cache, layer=layer, rows=rows)
        x = _rows(x, rows) + self.drop_path1(self.ls1(h))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


class PostNormBlock(Block):
    """Post-norm block (BERT): ``norm1(x + attn(x))`` then ``norm2(x + mlp(x))``."""

    def forward(
        self,
        x: Tensor,
        inputs: AttentionInputs | None = None,
        *,
        context: Tensor | None = None,
        cond: Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
        rows: slice | None = None,
    ) -> Tensor:
        h = self.attn(x, inputs, cache=cache, layer=layer, rows=rows)
        x = self.norm1(_rows(x, rows) + self.drop_path1(self.ls1(h)))
        x = self.norm2(x + self.drop_path2(self.ls2(self.mlp(x))))
        return x


class CrossAttentionBlock(Block):
    """Pre-norm decoder block: self-attention, then cross-attention to ``context (B, M, D_ctx)``
    (masked by ``inputs.context_mask``, which the backbone builds from the context's ``valid``), then
    the MLP.

    Args (beyond ``Block``'s): ``cross_attn``: an ``Attention(cross=True)``.
    """

    def __init__(
        self,
        d_model: int,
        attn: Attention,
        mlp: nn.Module,
        cross_attn: Attention,
        norm: str = "layernorm",
        norm_eps: float = 1e-6,
        drop_path: float = 0.0,
        layer_scale: float | None = None,
    ):
        super().__init__(d_model, attn, mlp, norm, norm_eps, drop_path, layer_scale)
        self.norm_cross, self.cross_attn = build_norm(norm, d_model, norm_eps), cross_attn
        self.ls_cross, self.drop_path_cross = _branch_tail(d_model, drop_path, layer_scale)

    def forward(
        self,
        x: Tensor,
        inputs: AttentionInputs | None = None,
        *,
        context: Tensor | None = None,
        cond: Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
        rows: slice | None = None,
    ) -> Tensor:
        h = self.attn(self.norm1(x), inputs, cache=cache, layer=layer, rows=rows)
        x = _rows(x, rows) + self.drop_path1(self.ls1(h))
        x = x + self.drop_path_cross(
            self.ls_cross(
                self.cross_attn(self.norm_cross(x), inputs, context=context, cache=cache, layer=layer)
            )
        )
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """``x (B, N, D) · (1 + scale) + shift`` with per-sample ``shift, scale (B, D)`` (DiT)."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class AdaLNBlock(nn.Module):
    """DiT block with adaLN-Zero conditioning on ``cond (B, Dc)`` (names as DiT: ``norm1``, ``attn``,
    ``norm2``, ``mlp``, ``adaLN_modulation``). Norms have no affine parameters: the modulation is
    the affine transform."""

    def __init__(
        self,
        d_model: int,
        attn: Attention,
        mlp: nn.Module,
        d_cond: int,
        norm_eps: float = 1e-6,
        drop_path: float = 0.0,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model, elementwise_affine=False, eps=norm_eps)
        self.attn = attn
        self.norm2 = nn.LayerNorm(d_model, elementwise_affine=False, eps=norm_eps)
        self.mlp = mlp
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d_cond, 6 * d_model))
        self.init_weights()

    def init_weights(self) -> None:
        """adaLN-Zero: zero modulation ⇒ every gate is 0 ⇒ the block starts as the identity (DiT §3.2)."""
        nn.init.zeros_(self.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.adaLN_modulation[-1].bias)

    def forward(
        self,
        x: Tensor,
        inputs: AttentionInputs | None = None,
        *,
        context: Tensor | None = None,
        cond: Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> Tensor:
        if cond is None:
            raise ValueError("AdaLNBlock needs a conditioning vector cond (B, Dc)")
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(cond).chunk(
            6, dim=-1
        )
        h = self.attn(modulate(self.norm1(x), shift_msa, scale_msa), inputs, cache=cache, layer=layer)
        x = x + self.drop_path(gate_msa.unsqueeze(1) * h)
        x = x + self.drop_path(
            gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        )
        return x
