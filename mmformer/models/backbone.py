"""The shared transformer backbone: a stack of blocks, the relative position scheme applied inside
attention (RoPE / ALiBi), the mask rules, and the final norm.

Tokenizers own embeddings (absolute positions included), heads own pooling and output projections
(DESIGN.md). ``build_backbone`` makes the standard variants from plain keyword arguments:

  ViT / BERT-style encoder  ``build_backbone(d_model=768, n_layers=12, n_heads=12)``
  GPT-2                     ``… causal=True, act="gelu_tanh"``
  Llama / SmolLM            ``… causal=True, norm="rmsnorm", act="swiglu", positions="rope",
                            n_kv_heads=3, qkv_bias=False, mlp_bias=False``
                            (``mmformer.models.pretrained`` imports the real weights)
  BERT (post-norm)          ``… block="post", norm_eps=1e-12``
  Whisper decoder           ``… causal=True, block="cross"``  (forward with ``context=``)
  DiT                       ``… block="adaln", d_cond=D``      (forward with ``cond=``)

Shape legend: B batch, N tokens, D model width, P position axes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn.attention import Attention, AttentionInputs, KVCache
from ..nn.blocks import AdaLNBlock, Block, CrossAttentionBlock, PostNormBlock
from ..nn.conformer import ConformerBlock
from ..nn.layout import decode_layout, train_layout
from ..nn.masks import MaskSpec, bigbird_layout
from ..nn.mlp import build_mlp
from ..nn.norms import build_norm
from ..nn.positions import RelativePositionBias, RotaryEmbedding, alibi_slopes
from ..nn.tokens import Tokens

BLOCKS = ("pre", "post", "cross", "adaln", "conformer")
POSITIONS = ("none", "rope", "alibi", "t5", "toeplitz")


def modality_spans(modality: Tensor, bidirectional: tuple[int, ...]) -> Tensor | None:
    """Span ids ``(B, N)``: each contiguous run of tokens whose modality is in ``bidirectional`` gets
    its own id (1, 2, …), other tokens 0 — the bidirectional image / audio spans of Transfusion."""
    if not bidirectional:
        return None
    inside = torch.isin(modality, torch.tensor(bidirectional, device=modality.device))
    prev_inside = torch.nn.functional.pad(inside[:, :-1], (1, 0), value=False)
    prev_mod = torch.nn.functional.pad(modality[:, :-1], (1, 0), value=-1)
    starts = inside & (~prev_inside | (prev_mod != modality))
    return torch.cumsum(starts.long(), dim=1) * inside


class Backbone(nn.Module):
    """Runs Tokens through ``blocks`` and the final ``norm``.

    Args:
        blocks: the block modules (all of one family).
        norm: the final norm (``nn.Identity()`` for none).
        causal: every query sees only earlier keys (decoders), except inside bidirectional spans.
        positions: ``none`` (absolute embeddings from the tokenizers), ``rope``, ``alibi``, or a learned
            relative bias shared by all layers: ``t5`` (``rel_buckets`` log buckets up to
            ``rel_max_distance``) or ``toeplitz`` (one value per offset up to ``rel_max_distance``).
        rope_base: RoPE θ; ``rope_axes``: 1 for sequences, 2 for patch grids (axial 2-D RoPE).
        window: sliding-window attention size in tokens, or None.
        bidirectional_modalities: modality ids whose contiguous runs attend bidirectionally in a
            causal model (``(MODALITY_IDS["image"],)`` makes an image prefix a prefix-LM prefix).
    """

    def __init__(
        self,
        blocks: list[nn.Module],
        norm: nn.Module,
        causal: bool = False,
        positions: str = "none",
        rope_base: float = 10_000.0,
        rope_axes: int = 1,
        window: int | None = None,
        bidirectional_modalities: tuple[int, ...] = (),
        rel_buckets: int = 32,
        rel_max_distance: int = 128,
        bigbird: dict | None = None,
    ):
        super().__init__()
        if positions not in POSITIONS:
            raise ValueError(f"unknown positions {positions!r}; choose from {POSITIONS}")
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm
        attn = self.blocks[0].attn
        self.d_model, self.n_layers, self.n_heads = attn.proj.out_features, len(blocks), attn.n_heads
        self.causal, self.positions, self.window = causal, positions, window
        self.bidirectional_modalities = tuple(bidirectional_modalities)
        self.rope = RotaryEmbedding(attn.head_dim, rope_base, rope_axes) if positions == "rope" else None
        # BigBird block-sparse attention: {"block": tokens per block, "pattern": (window, global, random)}
        self.bigbird = bigbird
        self.rel_bias = (
            RelativePositionBias(
                self.n_heads, positions, rel_buckets, rel_max_distance, bidirectional=not causal
            )
            if positions in ("t5", "toeplitz")
            else None
        )
        # ALiBi slopes are made per forward in float32 (a buffer would be rounded by .to(bfloat16)).

    def init_weights(self) -> None:
        """timm ViT init: trunc-normal(0.02) linear weights, zero biases, unit norms; blocks with their
        own ``init_weights`` (adaLN-Zero) re-apply it afterwards."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm | nn.RMSNorm) and m.weight is not None:
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for m in self.modules():
            if m is not self and hasattr(m, "init_weights"):
                m.init_weights()

    _decode_layout = False  # True while the blocks' weights are stored column-major (for_decoding)

    def for_decoding(self) -> None:
        """Store the blocks' CPU linear weights column-major (``mmformer.nn.layout``: the same values, a
        faster layout for the few rows of KV-cache decoding). Blocks compiled with ``torch.compile`` keep
        their layout (a new one would recompile them). Undone by the first forward that trains or
        records gradients, or by ``restore_layout``."""
        for block in self.blocks:
            if not getattr(block, "_mmformer_compiled", False):
                decode_layout(block)
        self._decode_layout = True

    def restore_layout(self) -> None:
        """Row-major weights again after ``for_decoding``. Training loops call it before a step's forward
        (``MultiTaskModule.on_train_batch_start``): DDP fixes its gradient buckets' layout from the
        weights' at its first steps, before the module's own forward runs."""
        if self._decode_layout:
            train_layout(self)
            self._decode_layout = False

    def set_attn_kernel(self, kernel: str) -> None:
        """Switch every attention kernel (``eager`` to count FLOPs, ``sdpa`` to train, …)."""
        for m in self.modules():
            if isinstance(m, Attention):
                m.kernel = kernel

    def forward(
        self,
        tokens: Tokens,
        *,
        cond: Tensor | None = None,
        context: Tokens | None = None,
        cache: KVCache | None = None,
        span: Tensor | None = None,
    ) -> Tensor:
        """``tokens`` → hidden states ``(B, N, D)``.

        Args:
            cond: ``(B, Dc)`` conditioning vector (adaLN blocks).
            context: Tokens to cross-attend to (cross-attention blocks); its padding is never read.
            cache: KV cache; the new tokens follow the cached ones (their ``positions`` must continue).
            span: explicit bidirectional span ids ``(B, N)`` (prefix-LM over text); default from
                ``bidirectional_modalities``.
        """
        if self._decode_layout and (self.training or torch.is_grad_enabled()):
            self.restore_layout()  # gradients and the optimizer expect row-major weights
        past = cache.length if cache is not None else 0
        valid, document, positions = tokens.valid, tokens.document, tokens.positions
        if span is None:
            span = modality_spans(tokens.modality, self.bidirectional_modalities)
        if past and span is not None and cache.span_open is not None:
            if bool((cache.span_open & (span[:, 0] > 0)).any()):
                raise ValueError(
                    "a bidirectional span (prefix-LM prefix, image or audio) must be prefilled in one "
                    "chunk: this chunk starts inside a span that the cache already ends with"
                )
        if past:
            valid = torch.cat([cache.valid, valid], dim=1)
            document = torch.cat([cache.document, document], dim=1)
            positions = torch.cat([cache.positions, positions], dim=1)
            if span is not None:  # a span never reaches back into cached tokens
                span = torch.cat([span.new_zeros(span.shape[0], past), span], dim=1)
        layout = None
        if self.bigbird is not None:  # one block pattern over the whole (cached + new) sequence
            n_blocks = -(-valid.shape[1] // self.bigbird["block"])
            layout = bigbird_layout(n_blocks, *self.bigbird["pattern"]).to(valid.device)
        mask = MaskSpec.from_tokens(
            valid,
            document,
            self.causal,
            span,
            self.window,
            past,
            layout,
            self.bigbird["block"] if layout is not None else 0,
        )
        inputs = AttentionInputs(
            mask=mask,
            rope=self.rope(tokens.positions) if self.rope is not None else None,
            alibi_slopes=alibi_slopes(self.n_heads).to(tokens.x.device)
            if self.positions == "alibi"
            else None,
            q_pos=tokens.positions[..., 0],
            k_pos=positions[..., 0],
        )
        if self.rel_bias is not None:  # one learned bias for every layer, from the positions' offsets
            inputs.rel_table = self.rel_bias.table
            inputs.rel_buckets = self.rel_bias.buckets(inputs.q_pos, inputs.k_pos)
        ctx = None
        if context is not None:
            ctx = context.x
            inputs.context_mask = MaskSpec(valid=None if context.all_valid else context.valid)
        x = tokens.x
        for i, block in enumerate(self.blocks):
            x = block(x, inputs, context=ctx, cond=cond, cache=cache, layer=i)
        if cache is not None:
            cache.extend(tokens.valid, tokens.document, tokens.positions)
            cache.span_open = span[:, -1] > 0 if span is not None else torch.zeros_like(tokens.valid[:, -1])
        return self.norm(x)


def build_backbone(
    d_model: int,
    n_layers: int,
    n_heads: int,
    *,
    n_kv_heads: int | None = None,
    mlp_ratio: float = 4.0,
    block: str = "pre",
    norm: str = "layernorm",
    norm_eps: float = 1e-6,
    act: str = "gelu",
    qkv_bias: bool = True,
    proj_bias: bool = True,
    mlp_bias: bool = True,
    qk_norm: bool = False,
    drop: float = 0.0,
    attn_drop: float = 0.0,
    drop_path: float = 0.0,
    layer_scale: float | None = None,
    causal: bool = False,
    positions: str = "none",
    rope_base: float = 10_000.0,
    rope_axes: int = 1,
    window: int | None = None,
    bidirectional_modalities: tuple[int, ...] = (),
    d_cond: int | None = None,
    d_context: int | None = None,
    final_norm: bool = True,
    attn_kernel: str = "auto",
    sdpa_backend: str = "auto",
    mlp_hidden: int | None = None,
    conv_kernel: int = 31,
    rel_buckets: int = 32,
    rel_max_distance: int = 128,
    performer_features: int = 256,
    bigbird_block: int | None = None,
    bigbird_window: int = 1,
    bigbird_global: int = 1,
    bigbird_random: int = 1,
) -> Backbone:
    """A ``Backbone`` of ``n_layers`` blocks of family ``block`` (``pre``, ``post``, ``cross``, ``adaln``,
    ``conformer``: ``mlp_ratio`` sizes its feed-forwards, ``conv_kernel`` its depthwise convolution).

    Stochastic depth rises linearly over depth to ``drop_path`` (DeiT). ``mlp_hidden`` overrides
    ``mlp_ratio · d_model`` (Llama-style sizes); ``proj_bias`` is the attention output bias. Raises
    ``ValueError`` on an unknown family, norm, activation or position scheme, or on indivisible head counts.
    """
    if block not in BLOCKS:
        raise ValueError(f"unknown block {block!r}; choose from {BLOCKS}")
    hidden = mlp_hidden or int(d_model * mlp_ratio)

    def attention(cross: bool = False) -> Attention:
        attn = Attention(
            d_model,
            n_heads,
            n_kv_heads,
            qkv_bias,
            attn_drop,
            drop,
            attn_kernel,
            qk_norm,
            cross=cross,
            d_context=d_context,
            sdpa_backend=sdpa_backend,
            proj_bias=proj_bias,
        )
        attn.n_features = performer_features
        return attn

    blocks = []
    for i in range(n_layers):
        dp = drop_path * i / max(n_layers - 1, 1)
        mlp = build_mlp(d_model, hidden, act, mlp_bias, drop)
        if block == "pre":
            blocks.append(Block(d_model, attention(), mlp, norm, norm_eps, dp, layer_scale))
        elif block == "post":
            blocks.append(PostNormBlock(d_model, attention(), mlp, norm, norm_eps, dp, layer_scale))
        elif block == "cross":
            blocks.append(
                CrossAttentionBlock(
                    d_model, attention(), mlp, attention(cross=True), norm, norm_eps, dp, layer_scale
                )
            )
        elif block == "conformer":
            blocks.append(ConformerBlock(d_model, attention(), hidden, conv_kernel, drop, norm_eps))
        else:
            blocks.append(AdaLNBlock(d_model, attention(), mlp, d_cond or d_model, norm_eps, dp))
    final = build_norm(norm, d_model, norm_eps) if final_norm and block != "post" else nn.Identity()
    backbone = Backbone(
        blocks,
        final,
        causal,
        positions,
        rope_base,
        rope_axes,
        window,
        bidirectional_modalities,
        rel_buckets,
        rel_max_distance,
        {"block": bigbird_block, "pattern": (bigbird_window, bigbird_global, bigbird_random)}
        if bigbird_block
        else None,
    )
    backbone.init_weights()
    return backbone
