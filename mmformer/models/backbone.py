"""The shared transformer backbone: a stack of blocks and the final norm.

It owns the blocks and the final norm, and (when a model uses one) the relative position scheme
applied inside attention; the pre-norm ViT / GPT-2 trunk here uses the absolute position embeddings
its tokenizers add, so ``Tokens.positions`` is not read. Tokenizers own embeddings, heads own pooling
and output projections (DESIGN.md).
Shape legend: B batch, N tokens, D model width.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..nn.blocks import Block
from ..nn.masks import MaskSpec
from ..nn.tokens import Tokens


class Backbone(nn.Module):
    """Pre-norm transformer encoder/decoder trunk (ViT / GPT-2 layout, timm names ``blocks``, ``norm``).

    Args:
        d_model: width ``D``.
        n_layers: number of blocks.
        n_heads: attention heads; ``n_kv_heads`` for grouped-query attention.
        mlp_ratio: MLP hidden width / ``D``.
        qkv_bias: bias on the fused qkv projections.
        drop, attn_drop: dropout rates (training only).
        drop_path: stochastic depth, increasing linearly over depth to this value (DeiT).
        norm_eps: LayerNorm epsilon.
        final_norm: apply the final LayerNorm (``norm``); timm's average-pool ViTs replace it by the
            head's ``fc_norm``.
        causal: every query sees only earlier keys (decoders).
        attn_kernel: ``auto`` / ``sdpa`` / ``eager`` (see ``mmformer.nn.attention``).

    ``forward(tokens) → (B, N, D)`` hidden states; padding tokens (``tokens.valid`` False) are never
    attended to, and ``tokens.document`` restricts attention to each packed document.
    """

    def __init__(
        self,
        d_model: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        norm_eps: float = 1e-6,
        final_norm: bool = True,
        causal: bool = False,
        attn_kernel: str = "auto",
    ):
        super().__init__()
        self.d_model, self.n_layers, self.n_heads = d_model, n_layers, n_heads
        self.mlp_ratio, self.causal = mlp_ratio, causal
        dpr = [drop_path * i / max(n_layers - 1, 1) for i in range(n_layers)]  # stochastic depth decay
        self.blocks = nn.ModuleList(
            Block(
                d_model,
                n_heads,
                mlp_ratio,
                n_kv_heads,
                qkv_bias,
                "gelu",
                drop,
                attn_drop,
                p,
                norm_eps,
                attn_kernel,
            )
            for p in dpr
        )
        self.norm = nn.LayerNorm(d_model, eps=norm_eps) if final_norm else nn.Identity()
        self.init_weights()

    def init_weights(self) -> None:
        """timm ViT init: trunc-normal(0.02) linear weights, zero biases, unit LayerNorms."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def set_attn_kernel(self, kernel: str) -> None:
        """Switch every block's attention kernel (``eager`` to count FLOPs, ``sdpa`` to train)."""
        for block in self.blocks:
            block.attn.kernel = kernel

    def forward(self, tokens: Tokens) -> Tensor:
        mask = MaskSpec.from_tokens(tokens.valid, tokens.document, self.causal)
        x = tokens.x
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)
