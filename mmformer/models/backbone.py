"""The shared transformer backbone: a stack of blocks, the relative position scheme applied inside
attention (RoPE / ALiBi / learned relative biases), the mask rules, and the final norm.

Tokenizers own embeddings (absolute positions included), heads own pooling and output projections
(DESIGN.md). ``build_backbone`` makes the standard variants from a few nested configs
(``mmformer.models.backbone_config``):

  ViT / BERT-style encoder  ``build_backbone(768, 12, AttentionConfig(12))``
  GPT-2                     ``… causal=True, mlp=MlpConfig(act="gelu_tanh")``
  Llama / SmolLM            ``… AttentionConfig(9, n_kv_heads=3, qkv_bias=False, proj_bias=False),
                            MlpConfig(hidden=1536, act="swiglu", bias=False), PositionConfig("rope"),
                            norm="rmsnorm", causal=True``
                            (``mmformer.models.pretrained`` imports the real weights)
  BERT (post-norm)          ``… block=BlockConfig("post"), norm_eps=1e-12``
  Whisper decoder           ``… block=BlockConfig("cross"), causal=True``  (forward with ``context=``)
  DiT                       ``… block=BlockConfig("adaln", d_cond=D)``      (forward with ``cond=``)
  Reformer-style reversible ``… block=BlockConfig(reversible=True, ff_chunks=4)`` (``mmformer.nn.reversible``)

What every layer's attention reads besides its input — the mask, RoPE angles, ALiBi / relative biases,
the sliding-window and BigBird layouts, and the mask's dense or ``BlockMask`` form — is computed once
in ``Backbone.forward`` and handed to every block as one read-only ``AttentionInputs``.

Shape legend: B batch, N tokens (Nk: cached + new), M context tokens, D model width, P position axes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..nn.attention import Attention, AttentionInputs, KVCache
from ..nn.blocks import AdaLNBlock, Block, CrossAttentionBlock, PostNormBlock
from ..nn.conformer import ConformerBlock
from ..nn.layout import decode_layout, train_layout
from ..nn.masks import MaskSpec
from ..nn.mlp import build_mlp
from ..nn.norms import build_norm
from ..nn.packed import release as release_packed
from ..nn.positions import RelativePositionBias, RotaryEmbedding, alibi_slopes
from ..nn.reversible import ReversibleBlock, reversible_stack
from ..nn.tokens import Tokens
from .backbone_config import (
    BLOCKS,
    POSITIONS,
    AttentionConfig,
    BlockConfig,
    LongContextConfig,
    MlpConfig,
    PositionConfig,
)

__all__ = ["BLOCKS", "POSITIONS", "Backbone", "build_backbone", "modality_spans"]


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
        blocks: the block modules (all of one family), each with an ``attn``; ``ReversibleBlock``s run
            as one reversible stack (``mmformer.nn.reversible.reversible_stack``).
        norm: the final norm (``nn.Identity()`` for none).
        causal: every query sees only earlier keys (decoders), except inside bidirectional spans.
        positions: the relative position scheme (``PositionConfig``; None: none): ``none`` (absolute
            embeddings from the tokenizers), ``rope``, ``alibi``, or a learned relative bias shared by
            all layers (``t5``, ``toeplitz``; its table is the backbone's ``rel_bias``).
        long_context: a sliding window and / or BigBird block sparsity (``LongContextConfig``; None: none).
        bidirectional_modalities: modality ids whose contiguous runs attend bidirectionally in a
            causal model (``(MODALITY_IDS["image"],)`` makes an image prefix a prefix-LM prefix).

    Raises ``ValueError`` for RoPE over an odd head width.
    """

    def __init__(
        self,
        blocks: list[nn.Module],
        norm: nn.Module,
        causal: bool = False,
        positions: PositionConfig | None = None,
        long_context: LongContextConfig | None = None,
        bidirectional_modalities: tuple[int, ...] = (),
    ):
        super().__init__()
        positions, long_context = positions or PositionConfig(), long_context or LongContextConfig()
        self.blocks = nn.ModuleList(blocks)
        self.reversible = isinstance(blocks[0], ReversibleBlock)  # the stack runs as one (nn.reversible)
        self.rows_computed: slice | None = None  # last forward's rows if its last block computed them alone
        self.norm = norm
        attn = self.blocks[0].attn
        self.d_model, self.n_layers, self.n_heads = attn.proj.out_features, len(blocks), attn.n_heads
        self.causal, self.positions, self.long_context = causal, positions, long_context
        self.bidirectional_modalities = tuple(bidirectional_modalities)
        self.rope = (
            RotaryEmbedding(attn.head_dim, positions.rope_base, positions.rope_axes)
            if positions.kind == "rope"
            else None
        )
        self.rel_bias = (
            RelativePositionBias(
                self.n_heads,
                positions.kind,
                positions.rel_buckets,
                positions.rel_max_distance,
                bidirectional=not causal,
            )
            if positions.kind in ("t5", "toeplitz")
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
    # ``run_blocks`` compiled, set by ``models.compiled_decoding`` for the duration of a decoding step
    compiled_blocks: Callable | None = None

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
            release_packed([self])  # the decoding loop's prepacked copies (nn.packed): memory back
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
        rows: slice | None = None,
    ) -> Tensor:
        """``tokens`` → hidden states ``(B, N, D)``, or ``(B, len(rows), D)`` with ``rows``.

        Args:
            cond: ``(B, Dc)`` conditioning vector (adaLN blocks).
            context: Tokens to cross-attend to (cross-attention blocks); its padding is never read.
            cache: KV cache; the new tokens follow the cached ones, so their ``positions`` must continue
                (``cache.next_positions(valid)``; ``Tokens.from_embeddings`` alone counts from 0).
            span: explicit bidirectional span ids ``(B, N)`` (prefix-LM over text); default from
                ``bidirectional_modalities``.
            rows: a slice of the token axis, the only rows the caller reads (a classifier's class token):
                the output is ``hidden[:, rows]``, and the last block computes only those rows past its
                attention's keys and values, plus the final norm (the same values; a ViT-S step does
                6.3 % fewer FLOPs) where it can: a block that ``takes_rows``, no cache, not reversible, an
                sdpa / eager kernel and a mask the same for every query (``rows_attend_alike``: padding at
                most). Elsewhere every row is computed and the rows selected. With dropout in training
                the last block draws masks for its computed rows only: the same distribution, other
                draws than the full forward's (stochastic depth draws per sample and is unchanged).

        Masks (``tokens.valid``, ``context.valid``) are bool, True = real token; another dtype raises
        ``TypeError`` (``mmformer.nn.masks.require_bool``).
        Raises ``ValueError`` when a chunk starts inside a bidirectional span the cache already ends with,
        or, when attention reads positions (RoPE, ALiBi, a relative bias), when a row's new tokens do not
        come after its cached ones (``_check_positions_continue``).
        """
        if self._decode_layout and (self.training or torch.is_grad_enabled()):
            self.restore_layout()  # gradients and the optimizer expect row-major weights
        if span is None:
            span = modality_spans(tokens.modality, self.bidirectional_modalities)
        inputs = self.attention_inputs(tokens, context, cache, span)
        ctx = context.x if context is not None else None
        x = tokens.x
        alone = rows is not None and self._rows_alone(x, inputs, cache)
        self.rows_computed = rows if alone else None  # what the last block computed (FlopMeter reads it)
        if alone:
            return self.norm(self.run_blocks(x, inputs, ctx, cond, rows=rows))
        if self.reversible:
            x = reversible_stack(self.blocks, x, inputs, cache)
        else:
            run = self.compiled_blocks if self.compiled_blocks is not None else self.run_blocks
            x = run(x, inputs, ctx, cond, cache)
        if cache is not None:
            cache.extend(tokens.valid, tokens.document, tokens.positions)
            cache.span_open = span[:, -1] > 0 if span is not None else torch.zeros_like(tokens.valid[:, -1])
        return self.norm(x if rows is None else x[:, rows])

    def run_blocks(
        self,
        x: Tensor,
        inputs: AttentionInputs,
        context: Tensor | None = None,
        cond: Tensor | None = None,
        cache: KVCache | None = None,
        rows: slice | None = None,
    ) -> Tensor:
        """The blocks in order over hidden states ``x (B, N, D)``, given what ``attention_inputs`` built:
        the part of ``forward`` with no data-dependent checks, so it traces as one graph. ``rows``: the
        last block computes only those rows (``(B, len(rows), D)``; see ``forward``)."""
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            keep = {"rows": rows} if rows is not None and i == last else {}
            x = block(x, inputs, context=context, cond=cond, cache=cache, layer=i, **keep)
        return x

    def _rows_alone(self, x: Tensor, inputs: AttentionInputs, cache: KVCache | None) -> bool:
        """Whether the last block can compute a subset of rows alone (``forward``'s ``rows``)."""
        last = self.blocks[-1]
        return (
            cache is None
            and not self.reversible
            and getattr(last, "takes_rows", False)
            and inputs.rows_attend_alike()
            and last.attn.resolve_kernel(x, inputs) in ("sdpa", "eager")
        )

    def attention_inputs(
        self, tokens: Tokens, context: Tokens | None, cache: KVCache | None, span: Tensor | None
    ) -> AttentionInputs:
        """What every layer's attention reads in this forward, built once: the mask over the cached and
        new keys (with the window and BigBird layout), RoPE angles, ALiBi slopes, the relative-bias
        buckets, the context's mask, and these masks in the forms the layers' kernels take."""
        past = cache.length if cache is not None else 0
        valid, document, positions = tokens.valid, tokens.document, tokens.positions
        if past and span is not None and cache.span_open is not None:
            if bool((cache.span_open & (span[:, 0] > 0)).any()):
                raise ValueError(
                    "a bidirectional span (prefix-LM prefix, image or audio) must be prefilled in one "
                    "chunk: this chunk starts inside a span that the cache already ends with"
                )
        if past and (self.rope is not None or self.rel_bias is not None or self.positions.kind == "alibi"):
            _check_positions_continue(tokens, cache)
        if past:
            valid = torch.cat([cache.valid, valid], dim=1)  # (B, Nk)
            document = torch.cat([cache.document, document], dim=1)
            positions = torch.cat([cache.positions, positions], dim=1)  # (B, Nk, P)
            if span is not None:  # a span never reaches back into cached tokens
                span = torch.cat([span.new_zeros(span.shape[0], past), span], dim=1)
        bigbird = self.long_context.bigbird
        layout = None  # a block pattern per layer and head over the whole (cached + new) sequence
        if bigbird is not None:
            layout = bigbird.layer_layouts(
                valid.shape[1], self.causal, self.n_heads, self.n_layers, valid.device
            )
        mask = MaskSpec.from_tokens(
            valid,
            document,
            self.causal,
            span,
            self.long_context.window,
            past,
            layout,
            bigbird.block if bigbird is not None else 0,
        )
        q_pos, k_pos = tokens.positions[..., 0], positions[..., 0]  # (B, N), (B, Nk)
        inputs = AttentionInputs(
            mask=mask,
            context_mask=MaskSpec(valid=None if context is None or context.all_valid else context.valid),
            rope=self.rope(tokens.positions) if self.rope is not None else None,
            alibi_slopes=alibi_slopes(self.n_heads).to(tokens.x.device)
            if self.positions.kind == "alibi"
            else None,
            # one learned bias for every layer, from the positions' offsets
            rel_table=self.rel_bias.table if self.rel_bias is not None else None,
            rel_buckets=self.rel_bias.buckets(q_pos, k_pos) if self.rel_bias is not None else None,
            q_pos=q_pos,
            k_pos=k_pos,
        )
        x = tokens.x
        kernels = {block.attn.resolve_kernel(x, inputs) for block in self.blocks}
        cross = [block.cross_attn for block in self.blocks if hasattr(block, "cross_attn")]
        context_kernels = set()
        if context is not None:
            context_kernels = {attn.resolve_kernel(x, inputs.for_context()) for attn in cross}
        n = x.shape[1]
        n_context = context.x.shape[1] if context is not None else 0
        return inputs.prepared(kernels, n, past + n, x.shape[0], x.device, context_kernels, n_context)


def _check_positions_continue(tokens: Tokens, cache: KVCache) -> None:
    """Raises ``ValueError`` when a row's new real tokens of the document its cache ends in start at or
    before that document's last cached real position: positions that restart (``Tokens.from_embeddings``
    counts from 0) would make attention read the new tokens as the sequence's first ones. A new
    document may restart its positions. One device sync per cached forward."""
    doc = cache.document[:, -1:]  # (B, 1): the document the cache ends in
    cached = cache.valid & (cache.document == doc)  # (B, Nk_past)
    last = cache.positions[..., 0].masked_fill(~cached, -1).amax(dim=1)  # (B,), -1: none cached
    new = tokens.valid & (tokens.document == doc)  # (B, N)
    first = tokens.positions[..., 0].masked_fill(~new, torch.iinfo(torch.long).max).amin(dim=1)  # (B,)
    if bool((first <= last).any()):
        raise ValueError(
            "with a KV cache the new tokens' positions must continue after the cached ones, but they "
            "restart (Tokens.from_embeddings counts from 0): build them with "
            "positions=cache.next_positions(valid)"
        )


def build_backbone(
    d_model: int,
    n_layers: int,
    attention: AttentionConfig,
    *,
    mlp: MlpConfig | None = None,
    positions: PositionConfig | None = None,
    long_context: LongContextConfig | None = None,
    block: BlockConfig | None = None,
    norm: str = "layernorm",
    norm_eps: float = 1e-6,
    final_norm: bool = True,
    causal: bool = False,
    bidirectional_modalities: tuple[int, ...] = (),
) -> Backbone:
    """A ``Backbone`` of ``n_layers`` blocks of width ``d_model`` and family ``block.kind``, initialised
    (``Backbone.init_weights``).

    Args:
        attention: every layer's attention (a ``cross`` block's cross-attention too); its kernel options
            (``sdpa_backend``, ``performer_features``) go to each ``Attention``'s constructor.
        mlp: the feed-forwards (a ``conformer`` block's use ``mlp.hidden_dim`` and ``mlp.drop`` only).
        positions, long_context: see ``Backbone``.
        block: the family and its own settings; stochastic depth rises linearly over depth to
            ``block.drop_path`` (DeiT).
        norm: ``layernorm`` or ``rmsnorm`` (``adaln`` and ``conformer`` blocks use LayerNorm inside),
            ``norm_eps`` its epsilon; ``final_norm``: a norm after the last block (never after ``post``).
        causal, bidirectional_modalities: see ``Backbone``.

    A config left None takes its defaults: ``MlpConfig()``, ``PositionConfig()`` (no relative
    positions), ``LongContextConfig()`` (dense attention), ``BlockConfig()`` (pre-norm).
    Raises ``ValueError`` on an unknown norm, on indivisible head counts, or on RoPE with an odd head width.
    """
    mlp, block = mlp or MlpConfig(), block or BlockConfig()
    hidden = mlp.hidden_dim(d_model)

    def attend(cross: bool = False) -> Attention:
        a = attention
        return Attention(
            d_model,
            a.n_heads,
            n_kv_heads=a.n_kv_heads,
            qkv_bias=a.qkv_bias,
            attn_drop=a.attn_drop,
            proj_drop=a.proj_drop,
            kernel=a.kernel,
            qk_norm=a.qk_norm,
            cross=cross,
            d_context=block.d_context,
            sdpa_backend=a.sdpa_backend,
            proj_bias=a.proj_bias,
            performer_features=a.performer_features,
            kernel_options=a.kernel_options,
        )

    def make(i: int) -> nn.Module:
        dp = block.drop_path * i / max(n_layers - 1, 1)
        # made first for every family, the conformer too (which makes its own feed-forwards and drops
        # this one): the random stream, and so every initial weight, stays as it has always been
        ffn = build_mlp(d_model, hidden, mlp.act, mlp.bias, mlp.drop)
        if block.kind == "pre" and block.reversible:
            return ReversibleBlock(
                d_model, attend(), ffn, norm, norm_eps, dp, block.layer_scale, block.ff_chunks
            )
        if block.kind == "pre":
            return Block(d_model, attend(), ffn, norm, norm_eps, dp, block.layer_scale)
        if block.kind == "post":
            return PostNormBlock(d_model, attend(), ffn, norm, norm_eps, dp, block.layer_scale)
        if block.kind == "cross":
            return CrossAttentionBlock(
                d_model, attend(), ffn, attend(cross=True), norm, norm_eps, dp, block.layer_scale
            )
        if block.kind == "conformer":
            return ConformerBlock(d_model, attend(), hidden, block.conv_kernel, mlp.drop, norm_eps)
        return AdaLNBlock(d_model, attend(), ffn, block.d_cond or d_model, norm_eps, dp)

    blocks = [make(i) for i in range(n_layers)]
    final = build_norm(norm, d_model, norm_eps) if final_norm and block.kind != "post" else nn.Identity()
    backbone = Backbone(blocks, final, causal, positions, long_context, bidirectional_modalities)
    backbone.init_weights()
    return backbone
