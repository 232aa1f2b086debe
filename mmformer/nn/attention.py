"""Multi-head attention: one module for self- and cross-attention, with switchable kernels.

Projections (timm / whisper names): self-attention has one fused ``qkv`` of width
``(H + 2·Hkv)·Dh``; cross-attention has ``q`` plus a fused ``kv``; both end in ``proj``.

Kernels:
  * ``eager`` — the readable reference, ``softmax(q kᵀ / √Dh + bias, masked) v`` written out. Every
    fused kernel is tested against it; FLOPs can be counted on it on CPU.
  * ``sdpa`` — ``F.scaled_dot_product_attention`` (FlashAttention / memory-efficient / cuDNN on GPU;
    ``sdpa_backend`` forces one through ``torch.nn.attention.sdpa_kernel``), with a dense bool mask
    or the ``is_causal`` fast path.
  * ``flex`` — FlexAttention: the mask as a ``BlockMask`` built from the same rule, ALiBi as a score
    modification, no dense ``N × N`` tensor. Compiled on GPU; on CPU torch runs it uncompiled and
    forward-only (it refuses inputs that require grad).
  * ``auto`` — the fastest kernel that is correct here: ``flex`` on CUDA for the masks sdpa can only
    take densely (documents, spans, windows, ALiBi), otherwise ``sdpa`` (always on CPU when training).

Options: grouped-query / multi-query attention (``n_kv_heads``; Ainslie et al. 2023,
arXiv:2305.13245), QK-norm (RMSNorm over each head's queries and keys; Dehghani et al. 2023,
arXiv:2302.05442), RoPE and ALiBi (``mmformer.nn.positions``), attention dropout (training only),
and a KV cache for incremental decoding (``KVCache``). Fully masked query rows return zeros.
Reference: Vaswani et al. 2017 (arXiv:1706.03762) §3.2.

Shape legend: B batch, Nq queries, Nk keys, D model width, H query heads, Hkv key/value heads,
Dh head width.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .masks import MaskSpec, to_additive
from .positions import RotaryEmbedding

KERNELS = ("auto", "eager", "sdpa", "flex", "performer")
SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")


@dataclass
class AttentionInputs:
    """What every layer's attention needs besides its input, computed once per forward.

    Attributes:
        mask: who may attend to whom (self-attention).
        context_mask: which context tokens cross-attention may read (their ``valid``).
        rope: ``(cos, sin)`` for the queries' positions, ``(B, 1, Nq, Dh)`` each, or None.
        alibi_slopes: ``(H,)`` ALiBi slopes, or None.
        rel_table, rel_buckets: a learned relative position bias ``table[bucket(q, k), h]`` (or None).
        q_pos: ``(B, Nq)`` query positions (ALiBi); k_pos: ``(B, Nk)`` key positions.
    """

    mask: MaskSpec = field(default_factory=MaskSpec)
    context_mask: MaskSpec = field(default_factory=MaskSpec)
    rope: tuple[Tensor, Tensor] | None = None
    alibi_slopes: Tensor | None = None
    rel_table: Tensor | None = None  # (buckets, H) learned relative position bias (T5 / Toeplitz)
    rel_buckets: Tensor | None = None  # (B, Nq, Nk) long: each query–key pair's bucket
    rel_dense: Tensor | None = None  # (B, H, Nq, Nk) the bias itself, gathered once per forward
    q_pos: Tensor | None = None
    k_pos: Tensor | None = None
    block_mask: object | None = None  # FlexAttention BlockMask, built once per forward by the first layer
    # eager / sdpa: (mask, Nq, Nk, dense mask or None, its fully masked query rows or None), built once
    # per forward by the first layer and reused by the others
    dense_mask: tuple | None = field(default=None, repr=False)


class KVCache:
    """Keys and values of past tokens, per layer, plus the per-token metadata masks need.

    ``Backbone.forward(tokens, cache=cache)`` appends the new tokens; the cache never supplies positions
    (the caller's Tokens do, counting on from the cache length). Keys and values of padding are stored
    zeroed (``Attention`` zeroes them as they enter), so later steps need not zero the cache again.

    Keys and values live in buffers with room to grow (capacity doubled when full, as a ``list``), so a
    decoding step writes its one new position instead of copying the whole cache (``torch.cat`` each
    step, as transformers' default ``DynamicCache``, moves O(N) bytes per step and layer); ``keys`` /
    ``values`` are views of the filled part. For inference (under ``torch.no_grad``): appends write in
    place, so autograd refuses a backward through several cached steps.
    """

    def __init__(self, capacity: int = 0) -> None:
        """``capacity``: positions to make room for at the first append (the prompt plus the tokens to
        decode, when the caller knows them: one allocation, no doubling)."""
        self.capacity = capacity
        self.keys: dict[int, Tensor] = {}  # layer → (B, Hkv, Nk, Dh), a view of the layer's buffer
        self.values: dict[int, Tensor] = {}
        self._buffers: dict[int, tuple[Tensor, Tensor]] = {}  # layer → (B, Hkv, capacity, Dh) each
        self.valid: Tensor | None = None  # (B, Nk) bool
        self.document: Tensor | None = None  # (B, Nk) long
        self.positions: Tensor | None = None  # (B, Nk, P) long
        self.span_open: Tensor | None = (
            None  # (B,) bool: the last cached token is inside a bidirectional span
        )
        # cross-attention keys/values of the context (encoder–decoder): computed at the first step and
        # reused by every later one, since the context does not change while decoding
        self.cross: dict[int, tuple[Tensor, Tensor]] = {}  # layer → (B, Hkv, M, Dh) each

    @property
    def length(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k, v (B, Hkv, Nq, Dh)`` for ``layer``; returns all keys and values so far (views)."""
        n = self.keys[layer].shape[2] if layer in self.keys else 0
        end = n + k.shape[2]
        buf_k, buf_v = self._buffers.get(layer, (None, None))
        if buf_k is None or end > buf_k.shape[2]:
            room = self.capacity if buf_k is None and self.capacity >= end else max(2 * end, 16)
            shape = (*k.shape[:2], room, k.shape[3])
            grown_k, grown_v = k.new_empty(shape), v.new_empty(shape)
            if n:
                grown_k[:, :, :n], grown_v[:, :, :n] = self.keys[layer], self.values[layer]
            buf_k, buf_v = self._buffers[layer] = grown_k, grown_v
        buf_k[:, :, n:end], buf_v[:, :, n:end] = k, v
        self.keys[layer], self.values[layer] = buf_k[:, :, :end], buf_v[:, :, :end]
        return self.keys[layer], self.values[layer]

    def reorder(self, index: Tensor, cross: bool = True) -> None:
        """Keep batch rows ``index (B',)`` long, in that order (beam search: each surviving hypothesis
        continues from its parent's keys and values; a row may be repeated). ``cross=False`` leaves the
        cross-attention keys/values as they are: right when every row keeps its source (beams of one
        source replacing each other), and it saves copying them every step."""
        pick = lambda t: None if t is None else t.index_select(0, index)
        for layer, (buf_k, buf_v) in self._buffers.items():  # whole buffers: their room is kept
            n = self.keys[layer].shape[2]
            buf_k, buf_v = self._buffers[layer] = pick(buf_k), pick(buf_v)
            self.keys[layer], self.values[layer] = buf_k[:, :, :n], buf_v[:, :, :n]
        self.valid, self.document, self.positions = (
            pick(self.valid),
            pick(self.document),
            pick(self.positions),
        )
        self.span_open = pick(self.span_open)
        if cross:
            self.cross = {layer: (pick(k), pick(v)) for layer, (k, v) in self.cross.items()}

    def extend(self, valid: Tensor, document: Tensor, positions: Tensor) -> None:
        """Append the new tokens' metadata (called once per forward, after every layer ran)."""
        cat = lambda old, new: new if old is None else torch.cat([old, new], dim=1)
        self.valid, self.document = cat(self.valid, valid), cat(self.document, document)
        self.positions = cat(self.positions, positions)


def _zero_padding(k: Tensor, v: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """``k, v (B, Hkv, N, Dh)`` with the positions where ``valid (B, N)`` is False set to 0."""
    pad = ~valid[:, None, :, None]  # (B, 1, N, 1)
    return k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)


def _decoding_mask(mask: MaskSpec, n_k: int) -> MaskSpec:
    """``mask`` without its causal rule when that rule hides nothing: every query sits at or after the
    last key (one new token decoded against a KV cache), so ``k <= q`` holds for every key and a
    bidirectional span can only re-allow what is allowed already. Padding, document and window rules
    are kept (a window without causality also bounds ``k - q``, which is never positive here)."""
    if mask.causal and mask.q_offset >= n_k - 1:
        return replace(mask, causal=False, span=None)
    return mask


def eager_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None = None, dropout_p: float = 0.0
) -> Tensor:
    """Reference attention. ``q (B, H, Nq, Dh)``, ``k, v (B, H, Nk, Dh)``, ``mask`` bool broadcastable to
    ``(B, H, Nq, Nk)`` (True = may attend), ``bias`` additive float. Fully masked rows return zeros."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, Nq, Nk)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    attn = scores.softmax(dim=-1).nan_to_num(0.0).to(q.dtype)  # a fully masked row → 0
    if dropout_p > 0.0:
        attn = F.dropout(attn, p=dropout_p)
    return attn @ v  # (B, H, Nq, Dh)


_compiled_flex = None


def flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask, score_mod=None) -> Tensor:
    """FlexAttention, compiled once on accelerators; uncompiled (the slow reference path) on CPU."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    global _compiled_flex
    if q.device.type == "cpu":
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ValueError(
                "FlexAttention has no backward pass on CPU: train with kernel sdpa (or auto), "
                "or run flex under torch.no_grad()"
            )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return flex(
                q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1]
            )
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex, dynamic=False)
    return _compiled_flex(
        q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1]
    )


class Attention(nn.Module):
    """Self-attention (``cross=False``) or cross-attention from a context (``cross=True``).

    Args:
        d_model: width ``D``; must be divisible by ``n_heads``.
        n_heads: query heads ``H``.
        n_kv_heads: key/value heads (``None`` → ``n_heads``; 1 = multi-query); must divide ``n_heads``.
        qkv_bias: bias on the input projections.
        proj_bias: bias on the output projection (timm and BERT have one, Llama has none).
        attn_drop: dropout on attention weights (training only).
        proj_drop: dropout after the output projection.
        kernel: one of ``KERNELS``; can be switched later (``attn.kernel = "eager"``).
        qk_norm: RMSNorm over each head's queries and keys before the dot product.
        cross: cross-attention: queries from ``x``, keys and values from ``context``.
        d_context: context width (cross-attention; default ``d_model``).
        sdpa_backend: force an SDPA backend on CUDA (``flash``, ``efficient``, ``cudnn``, ``math``).

    Raises:
        ValueError: indivisible widths / head counts, or an unknown kernel or backend.
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
        qk_norm: bool = False,
        cross: bool = False,
        d_context: int | None = None,
        sdpa_backend: str = "auto",
        proj_bias: bool = True,
    ):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")
        if sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"unknown sdpa_backend {sdpa_backend!r}; choose from {SDPA_BACKENDS}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.kernel, self.sdpa_backend, self.attn_drop, self.cross = kernel, sdpa_backend, attn_drop, cross
        H, Hkv, Dh = n_heads, n_kv_heads, self.head_dim
        if cross:
            self.q = nn.Linear(d_model, H * Dh, bias=qkv_bias)
            self.kv = nn.Linear(d_context or d_model, 2 * Hkv * Dh, bias=qkv_bias)
        else:
            self.qkv = nn.Linear(d_model, (H + 2 * Hkv) * Dh, bias=qkv_bias)
        self.q_norm = nn.RMSNorm(Dh, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(Dh, eps=1e-6) if qk_norm else nn.Identity()
        self.proj = nn.Linear(H * Dh, d_model, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    @property
    def kernel(self) -> str:
        return self._kernel

    @kernel.setter
    def kernel(self, kernel: str) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose from {KERNELS}")
        self._kernel = kernel

    # ------------------------------------------------------------------ projections
    def _project(
        self, x: Tensor, context: Tensor | None, cache: KVCache | None = None, layer: int = 0
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``x (B, Nq, D)`` (and ``context (B, M, D_ctx)``) → ``q (B, H, Nq, Dh)``, ``k, v (B, Hkv, Nk, Dh)``;
        cross-attention takes ``k, v`` from ``cache.cross[layer]`` when there (raises ``ValueError`` if
        they belong to a context of another shape)."""
        B, N, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        if self.cross:
            q = self.q(x).view(B, N, H, Dh).transpose(1, 2)  # (B, H, Nq, Dh)
            if cache is not None and layer in cache.cross:  # the context's keys/values, computed once
                k, v = cache.cross[layer]
                if k.shape[0] != B or k.shape[2] != context.shape[1]:
                    raise ValueError(
                        f"the KV cache holds cross-attention keys/values of another context ({k.shape[0]} rows "
                        f"× {k.shape[2]} tokens, not {B} × {context.shape[1]}): use a new KVCache per source batch"
                    )
                return self.q_norm(q), k, v
            M = context.shape[1]
            k, v = self.kv(context).view(B, M, 2 * Hkv, Dh).transpose(1, 2).split([Hkv, Hkv], dim=1)
            return self.q_norm(q), self.k_norm(k), v
        qkv = self.qkv(x).view(B, N, H + 2 * Hkv, Dh).transpose(1, 2)  # (B, H + 2·Hkv, N, Dh)
        q, k, v = qkv.split([H, Hkv, Hkv], dim=1)
        return self.q_norm(q), self.k_norm(k), v

    def forward(
        self,
        x: Tensor,
        inputs: AttentionInputs | MaskSpec | None = None,
        context: Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> Tensor:
        """``x (B, Nq, D)`` → ``(B, Nq, D)``.

        ``inputs``: mask, RoPE angles and ALiBi for this forward (or just a ``MaskSpec``).
        ``context (B, Nk, D_ctx)``: the cross-attention source.
        ``cache``: self-attention appends this forward's keys/values to ``layer``'s cache and attends
        over all of them; cross-attention projects ``context`` once, at the first call for ``layer``,
        and reuses those keys/values afterwards (``cache.cross``; the context must not change).
        """
        if inputs is None or isinstance(inputs, MaskSpec):  # a bare mask is enough for most uses
            inputs = AttentionInputs(mask=inputs or MaskSpec())
        if self.cross:
            if context is None:
                raise ValueError("cross-attention needs a context")
            inputs = AttentionInputs(mask=inputs.context_mask)  # no causality, RoPE or ALiBi across sequences
        B, Nq, _ = x.shape
        q, k, v = self._project(x, context, cache, layer)
        if inputs.rope is not None and not self.cross:
            cos, sin = inputs.rope
            q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        cached = cache is not None
        if cached and self.cross:
            if layer not in cache.cross:  # first step: zero the context's padding once, then keep them
                if inputs.mask.valid is not None:
                    k, v = _zero_padding(k, v, inputs.mask.valid)
                cache.cross[layer] = (k, v)
        elif cached:
            valid = inputs.mask.valid  # (B, Nk): the cached keys' validity, then the new ones'
            if valid is not None:  # zero the new padding once, as it enters the cache (see _attend)
                k, v = _zero_padding(k, v, valid[:, valid.shape[1] - k.shape[2] :])
            k, v = cache.update(layer, k, v)  # (B, Hkv, Nk, Dh)
        out = self._attend(q, k, v, inputs, padding_zeroed=cached)  # (B, H, Nq, Dh)
        out = out.transpose(1, 2).reshape(B, Nq, self.n_heads * self.head_dim)
        return self.proj_drop(self.proj(out))

    # ------------------------------------------------------------------ kernels
    def resolve_kernel(self, q: Tensor, inputs: AttentionInputs) -> str:
        """The kernel ``auto`` stands for, given the device, grad mode and mask."""
        if self.kernel != "auto":
            return self.kernel
        m = inputs.mask
        needs_dense = m.document is not None or m.span is not None or m.window is not None
        needs_dense = needs_dense or m.sparse_layout is not None
        needs_dense = needs_dense or inputs.alibi_slopes is not None or inputs.rel_table is not None
        decoding = (
            m.q_offset > 0
        )  # shapes change every step: a compiled flex kernel would recompile each time
        if q.device.type == "cuda" and needs_dense and self.attn_drop == 0.0 and not decoding:
            return "flex"
        return "sdpa"

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs, padding_zeroed: bool = False
    ) -> Tensor:
        mask, Nq, Nk = inputs.mask, q.shape[2], k.shape[2]
        # padded keys/values hold anything (even NaN): zero them, 0·NaN is NaN. From a KV cache they are
        # zeroed already: each token's padding was zeroed when it entered the cache (its validity never
        # changes afterwards), so decoding does not copy the whole cache again in every layer and step
        if mask.valid is not None and not padding_zeroed:
            k, v = _zero_padding(k, v, mask.valid)
        kernel = self.resolve_kernel(q, inputs)
        dropout_p = self.attn_drop if self.training else 0.0
        if kernel == "performer":
            return self._performer(q, k, v, mask)
        if kernel == "flex":
            if dropout_p > 0.0:
                raise ValueError("the flex kernel has no attention dropout; use sdpa or eager")
            if inputs.block_mask is None:  # built once, shared by every layer of this forward
                inputs.block_mask = mask.block_mask(q.shape[0], Nq, Nk, q.device)
            return flex_attention(q, k, v, inputs.block_mask, self._score_mod(inputs))
        bias = self._bias(inputs)
        mask = _decoding_mask(mask, Nk)
        fast_causal = mask.is_causal_only and Nq == Nk and bias is None
        dense, empty_rows = None, None
        if not (mask.is_full or fast_causal) or kernel == "eager":
            dense, empty_rows = self._dense(inputs, mask, Nq, Nk, q.device)
        if kernel == "eager":
            if self.n_kv_heads != self.n_heads:  # GQA: each group of H / Hkv query heads shares a kv head
                k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for t in (k, v))
            return eager_attention(q, k, v, dense, bias, dropout_p)
        attn_mask = dense
        if bias is not None:  # sdpa takes one additive float mask: the bias plus the mask's additive form
            attn_mask = bias.to(q.dtype) if dense is None else bias.to(q.dtype) + to_additive(dense, q.dtype)
        with self._sdpa_context(q):
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=fast_causal,
                enable_gqa=self.n_kv_heads != self.n_heads,
            )
        # sdpa's fully masked rows are backend-dependent (NaN or mean): make them 0
        if empty_rows is not None:
            out = out.masked_fill(empty_rows, 0.0)
        return out

    @staticmethod
    def _dense(
        inputs: AttentionInputs, mask: MaskSpec, Nq: int, Nk: int, device: torch.device
    ) -> tuple[Tensor | None, Tensor | None]:
        """``mask`` as a dense bool ``(B or 1, 1, Nq, Nk)`` tensor and its fully masked query rows
        ``(B or 1, 1, Nq, 1)`` (None on CPU when there are none); ``(None, None)`` when it allows
        everything. Built once per forward (every layer of a backbone shares ``inputs`` and the shapes),
        not once per layer."""
        cached = inputs.dense_mask
        if cached is not None and cached[0] is inputs.mask and cached[1:3] == (Nq, Nk):
            return cached[3], cached[4]
        dense = None if mask.is_full else mask.dense(Nq, Nk, device)
        empty_rows = None if dense is None else ~dense.any(dim=-1, keepdim=True)
        if (
            empty_rows is not None
            and empty_rows.device.type == "cpu"
            and not torch.compiler.is_compiling()  # a graph keeps the (fused) zeroing, not a break per layer
            and not bool(empty_rows.any())
        ):
            empty_rows = None  # no query row is fully masked (the usual case): nothing to zero in any layer
        inputs.dense_mask = (inputs.mask, Nq, Nk, dense, empty_rows)
        return dense, empty_rows

    n_features = 256  # performer: random features per head (set by the backbone's ``performer_features``)

    def _performer(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec) -> Tensor:
        """FAVOR+ (``nn.linear_attention``): causal or not, with padding; no documents, spans or windows."""
        from .linear_attention import favor_attention, orthogonal_features

        if (
            mask.document is not None
            or mask.span is not None
            or mask.window is not None
            or mask.q_offset
            or (mask.sparse_layout is not None)
        ):
            raise ValueError(
                "the performer kernel supports causal and padding masks only (no packed documents, "
                "bidirectional spans, sliding windows or KV cache)"
            )
        features = getattr(self, "_features", None)
        if features is None or features.shape != (self.n_features, self.head_dim):
            generator = torch.Generator().manual_seed(0)  # fixed features: the same function in eval
            self._features = features = orthogonal_features(self.n_features, self.head_dim, generator)
        if self.n_kv_heads != self.n_heads:
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for t in (k, v))
        return favor_attention(q, k, v, features, mask.causal, mask.valid)

    def _bias(self, inputs: AttentionInputs) -> Tensor | None:
        """The additive score bias ``(B, H, Nq, Nk)`` float32: ALiBi and / or a learned relative bias."""
        bias = None
        if inputs.alibi_slopes is not None:
            from .positions import alibi_bias

            bias = alibi_bias(inputs.alibi_slopes, inputs.q_pos, inputs.k_pos)
        if inputs.rel_table is not None:
            if inputs.rel_dense is None:  # every layer adds the same bias (T5): gather it once
                inputs.rel_dense = inputs.rel_table.float()[inputs.rel_buckets].permute(0, 3, 1, 2)
            bias = inputs.rel_dense if bias is None else bias + inputs.rel_dense
        return bias

    def _score_mod(self, inputs: AttentionInputs):
        mods = []
        if inputs.alibi_slopes is not None:
            slopes, qp, kp = inputs.alibi_slopes.float().to(inputs.q_pos.device), inputs.q_pos, inputs.k_pos
            mods.append(
                lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (qp[b, q_idx] - kp[b, kv_idx]).abs()
            )
        if inputs.rel_table is not None:
            table, buckets = inputs.rel_table, inputs.rel_buckets
            mods.append(lambda score, b, h, q_idx, kv_idx: score + table[buckets[b, q_idx, kv_idx], h])
        if not mods:
            return None
        if len(mods) == 1:
            return mods[0]

        def both(score, b, h, q_idx, kv_idx):
            for mod in mods:
                score = mod(score, b, h, q_idx, kv_idx)
            return score

        return both

    def _sdpa_context(self, q: Tensor):
        from contextlib import nullcontext

        if self.sdpa_backend == "auto" or q.device.type != "cuda":
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH,
        }[self.sdpa_backend]
        return sdpa_kernel(backend)
