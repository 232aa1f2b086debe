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

What a layer reads besides its input — the mask (True = may attend), RoPE angles, ALiBi and relative
biases — is one read-only ``AttentionInputs``. A backbone builds it once per forward, with the mask
already in the forms its layers' kernels take (``KernelMask``: a dense mask, a ``BlockMask``, the score
bias), so no layer builds them again and none writes anything for the next one.

Shape legend: B batch, Nq queries, Nk keys, D model width, H query heads, Hkv key/value heads,
Dh head width.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .block_sparse import GatherPlan, block_sparse_attention, gather_plan
from .kernels import KERNEL_CLASSES, build_kernel, softmax_flops
from .kv_cache import KVCache
from .linear_attention import favor_attention, favor_flops, orthogonal_features
from .masks import MaskSpec, require_bool, to_additive
from .onednn import onednn_linear, runs_own_forward, uses_onednn
from .positions import RotaryEmbedding, alibi_bias

KERNELS = ("auto", "eager", "sdpa", "flex", "performer", *KERNEL_CLASSES)  # + nn/kernels/*.py
SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")


@dataclass(frozen=True)
class KernelMask:
    """A mask and score bias in the forms the kernels read, for ``n_q`` queries and ``n_k`` keys.

    Built once per forward (``AttentionInputs.prepared``) and only read by every layer, so a backbone
    turns its mask into a dense tensor or a ``BlockMask`` once, not once per layer.

    Attributes:
        n_q, n_k: the query and key counts it was built for (a layer with others builds its own).
        kernels: the kernels it holds forms for (``eager``, ``sdpa``, ``flex``; ``performer`` needs none).
        bias: ``(B, H, Nq, Nk)`` float32 additive score bias (ALiBi plus a learned relative bias), or
            None: eager / sdpa (flex adds it as a score modification instead).
        dense: ``(B or 1, H or 1, Nq, Nk)`` bool, True = may attend, or None when no kernel needs it: eager
            (whenever the mask hides anything), sdpa (unless it takes the ``is_causal`` fast path or
            computes the mask block-sparse).
        empty_rows: ``(B or 1, H or 1, Nq, 1)`` bool, the fully masked query rows of ``dense`` (whose output
            is zeroed), or None when there are none (known on CPU) or no dense mask.
        block_mask: the FlexAttention ``BlockMask`` (flex), or None.
        gather: the ``GatherPlan`` by which sdpa computes this mask's block layout, gathering the key
            blocks each query block reads (``nn.block_sparse``: BigBird's cost, linear in length), or None
            (a dense mask). Planned here, outside the layers, so that an attention call reads no tensor's
            values (no host sync, no graph break in a compiled block).
    """

    n_q: int
    n_k: int
    kernels: frozenset[str]
    bias: Tensor | None = None
    dense: Tensor | None = None
    empty_rows: Tensor | None = field(default=None, repr=False)
    block_mask: object | None = field(default=None, repr=False)
    gather: GatherPlan | None = field(default=None, repr=False)


@dataclass(frozen=True)
class AttentionInputs:
    """What every layer's attention reads besides its input: built once per forward (``Backbone.forward``)
    and passed to every block; no layer writes to it.

    Attributes:
        mask: who may attend to whom (self-attention).
        context_mask: which context tokens cross-attention may read (their ``valid``).
        rope: ``(cos, sin)`` for the queries' positions, ``(B, 1, Nq, Dh)`` each, or None.
        alibi_slopes: ``(H,)`` ALiBi slopes, or None.
        rel_table, rel_buckets: a learned relative position bias ``table[bucket(q, k), h]``: ``(buckets, H)``
            and ``(B, Nq, Nk)`` long (or None).
        q_pos: ``(B, Nq)`` query positions (ALiBi, relative bias); k_pos: ``(B, Nk)`` key positions.
        kernel_mask, context_kernel_mask: ``mask`` / ``context_mask`` in the forms the layers' kernels
            read (``prepared``), or None: a layer then builds what it needs for its own call only. One
            ``KernelMask`` per layer (a tuple) when ``mask`` has a layout for each (``MaskSpec.per_layer``);
            a layer reads its own through ``for_layer``.
    """

    mask: MaskSpec = field(default_factory=MaskSpec)
    context_mask: MaskSpec = field(default_factory=MaskSpec)
    rope: tuple[Tensor, Tensor] | None = None
    alibi_slopes: Tensor | None = None
    rel_table: Tensor | None = None
    rel_buckets: Tensor | None = None
    q_pos: Tensor | None = None
    k_pos: Tensor | None = None
    kernel_mask: KernelMask | tuple[KernelMask, ...] | None = None
    context_kernel_mask: KernelMask | None = None

    def prepared(
        self,
        kernels: set[str],
        n_q: int,
        n_k: int,
        batch_size: int,
        device: torch.device,
        context_kernels: set[str] = frozenset(),
        n_context: int = 0,
    ) -> AttentionInputs:
        """These inputs with ``kernel_mask`` built for self-attention kernels ``kernels`` over ``n_q``
        queries and ``n_k`` keys, and ``context_kernel_mask`` for cross-attention kernels
        ``context_kernels`` over ``n_context`` context tokens (when any)."""
        bias = _score_bias(self) if set(kernels) & {"eager", "sdpa"} else None  # one for every layer
        if self.mask.per_layer:  # each layer's own block layout: its own forms, the same bias
            layers = range(self.mask.sparse_layout.shape[0])
            own = tuple(
                _kernel_mask(self.mask.for_layer(i), bias, kernels, n_q, n_k, batch_size, device)
                for i in layers
            )
        else:
            own = _kernel_mask(self.mask, bias, kernels, n_q, n_k, batch_size, device)
        ctx = None
        if context_kernels:
            ctx = _kernel_mask(self.context_mask, None, context_kernels, n_q, n_context, batch_size, device)
        return replace(self, kernel_mask=own, context_kernel_mask=ctx)

    def for_layer(self, layer: int) -> AttentionInputs:
        """What layer ``layer`` reads: its own block layout and prepared masks where ``mask`` has one
        layout per layer (``MaskSpec.per_layer``); else these inputs."""
        if not self.mask.per_layer:
            return self
        own = self.kernel_mask[layer] if isinstance(self.kernel_mask, tuple) else None
        return replace(self, mask=self.mask.for_layer(layer), kernel_mask=own)

    def rows_attend_alike(self) -> bool:
        """Every query row reads the same keys with the same scores' rule (at most padding hidden, no
        causality, documents, window, block sparsity or score bias): a subset of the query rows can be
        attended alone (``Attention.forward(rows=…)``)."""
        return self.mask.same_for_every_query and self.alibi_slopes is None and self.rel_table is None

    def for_context(self) -> AttentionInputs:
        """The inputs of cross-attention: the context's mask, no causality, RoPE or ALiBi across sequences."""
        return AttentionInputs(mask=self.context_mask, kernel_mask=self.context_kernel_mask)


def _score_bias(inputs: AttentionInputs) -> Tensor | None:
    """The additive score bias ``(B, H, Nq, Nk)`` float32: ALiBi and / or a learned relative bias."""
    bias = None
    if inputs.alibi_slopes is not None:
        bias = alibi_bias(inputs.alibi_slopes, inputs.q_pos, inputs.k_pos)
    if inputs.rel_table is not None:
        rel = inputs.rel_table.float()[inputs.rel_buckets].permute(0, 3, 1, 2)  # (B, H, Nq, Nk)
        bias = rel if bias is None else bias + rel
    return bias


def _kernel_mask(
    mask: MaskSpec,
    bias: Tensor | None,
    kernels: set[str],
    n_q: int,
    n_k: int,
    batch_size: int,
    device: torch.device,
) -> KernelMask:
    """``mask`` (and the additive score ``bias``, ``_score_bias``, or None) in the forms ``kernels`` read
    (see ``KernelMask``)."""
    kernels = frozenset(kernels)
    block_mask = mask.block_mask(batch_size, n_q, n_k, device) if "flex" in kernels else None
    if not kernels & {"eager", "sdpa"}:
        return KernelMask(n_q, n_k, kernels, block_mask=block_mask)
    mask = _decoding_mask(mask, n_k)
    fast_causal = mask.is_causal_only and n_q == n_k and bias is None
    gather = gather_plan(mask, n_q, n_k, device) if "sdpa" in kernels and bias is None else None
    gather = gather if gather is not None and gather.worth else None
    dense, empty_rows = None, None
    if not mask.is_full and ("eager" in kernels or not (fast_causal or gather is not None)):
        dense = mask.dense(n_q, n_k, device)
        empty_rows = ~dense.any(dim=-1, keepdim=True)
        if (
            empty_rows.device.type == "cpu"
            and not torch.compiler.is_compiling()  # a graph keeps the (fused) zeroing, not a break per layer
            and not bool(empty_rows.any())
        ):
            empty_rows = None  # no query row is fully masked (the usual case): nothing to zero in any layer
    return KernelMask(n_q, n_k, kernels, bias, dense, empty_rows, block_mask, gather)


def _hooked(m: nn.Module) -> bool:
    """Whether ``m`` has forward or backward hooks of its own. (Global module hooks are left out: tools
    install them for bookkeeping — ``FlopCounterMode``'s module tracker — and they would switch off what
    they measure.)"""
    return any(map(len, (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)))


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
    ``(B, H, Nq, Nk)`` (True = may attend), ``bias`` additive float. Fully masked rows return zeros.
    Scores and softmax in float32 at least (float64 inputs stay float64).
    Raises ``TypeError`` for a ``mask`` that is not bool (``nn.masks.require_bool``)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(dtype) @ k.to(dtype).transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, Nq, Nk)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~require_bool(mask), float("-inf"))
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
    if torch.compiler.is_compiling():  # inside a compiled region (a compiled block) flex compiles with it;
        # caching torch.compile(flex) here would store dynamo's view of it, the uncompiled function
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
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
        attn_drop: dropout on attention weights (training only).
        proj_drop: dropout after the output projection.
        kernel: one of ``KERNELS``; can be switched later (``attn.kernel = "eager"``).
        qk_norm: RMSNorm over each head's queries and keys before the dot product.
        cross: cross-attention: queries from ``x``, keys and values from ``context``.
        d_context: context width (cross-attention; default ``d_model``).
        sdpa_backend: force an SDPA backend on CUDA (``flash``, ``efficient``, ``cudnn``, ``math``).
        proj_bias: bias on the output projection (timm and BERT have one, Llama has none).
        performer_features: random features per head of the ``performer`` kernel (FAVOR+, drawn once
            with a fixed seed; ``mmformer.nn.linear_attention``).
        kernel_options: keyword options of a registered kernel (``mmformer.nn.kernels``: LSH, AFT, RFA …),
            e.g. ``{"n_buckets": 16}``; refused for a kernel that does not take them.

    Raises:
        ValueError: indivisible widths / head counts, an unknown kernel, kernel option or backend, or
        ``performer_features < 1``.
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
        performer_features: int = 256,
        kernel_options: dict | None = None,
    ):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")
        if sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"unknown sdpa_backend {sdpa_backend!r}; choose from {SDPA_BACKENDS}")
        if performer_features < 1:
            raise ValueError(f"performer_features must be >= 1, got {performer_features}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.performer_features, self.kernel_options = performer_features, dict(kernel_options or {})
        # the kernel after the head sizes and options: a registered kernel builds its module (nn/kernels)
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
        # a kernel that is a module of its own (nn/kernels); kept while another kernel is switched in for
        # a while (set_attn_kernel), so its parameters survive the round trip
        current = getattr(self, "kernel_module", None)
        if kernel in KERNEL_CLASSES and (current is None or current.name != kernel):
            self.kernel_module = build_kernel(kernel, self.n_heads, self.head_dim, self.kernel_options)
        elif current is None:
            self.kernel_module = None

    # ------------------------------------------------------------------ projections
    def _project(
        self,
        x: Tensor,
        context: Tensor | None,
        cache: KVCache | None = None,
        layer: int = 0,
        rows: slice | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``x (B, Nq, D)`` (and ``context (B, M, D_ctx)``) → ``q (B, H, Nq, Dh)``, ``k, v (B, Hkv, Nk, Dh)``;
        cross-attention takes ``k, v`` from ``cache.cross[layer]`` when there (raises ``ValueError`` if
        they belong to a context of another shape). ``rows``: ``q`` of those rows only, ``(B, H, len(rows),
        Dh)`` (``splits_qkv``: computed for them alone)."""
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
            k, v = (t.transpose(1, 2) for t in self.kv(context).view(B, M, 2 * Hkv, Dh).split(Hkv, dim=2))
            return self.q_norm(q), self.k_norm(k), v
        if rows is not None and self.splits_qkv():  # queries of those rows only, keys and values of all
            linear = onednn_linear if uses_onednn(self.qkv) else F.linear
            w, b = self.qkv.weight, self.qkv.bias
            xr = x[:, rows]
            q = linear(xr, w[: H * Dh], None if b is None else b[: H * Dh]).view(B, xr.shape[1], H, Dh)
            kv = linear(x, w[H * Dh :], None if b is None else b[H * Dh :]).view(B, N, 2 * Hkv, Dh)
            k, v = (t.transpose(1, 2) for t in kv.split([Hkv, Hkv], dim=2))
            return self.q_norm(q.transpose(1, 2)), self.k_norm(k), v
        # split on the head axis before the transposes (the same views): the backward's one concatenation
        # then writes the (B, N, ·, Dh) layout the projection's gradient needs, with no second copy
        qkv = self.qkv(x).view(B, N, H + 2 * Hkv, Dh)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([H, Hkv, Hkv], dim=2))  # (B, ·, N, Dh)
        if rows is not None:
            q = q[:, :, rows]
        return self.q_norm(q), self.k_norm(k), v

    def splits_qkv(self) -> bool:
        """Whether ``forward(rows=…)`` computes the queries of those rows only (the keys and values of every
        row): a self-attention whose ``qkv`` is a plain ``nn.Linear`` (on PyTorch's or oneDNN's products)
        without forward or backward hooks of its own. A wrapped product (LoRA) or a hooked one runs whole,
        and its other rows' queries are dropped; global module hooks do not see a split one run."""
        m = getattr(self, "qkv", None)
        return type(m) is nn.Linear and (runs_own_forward(m) or uses_onednn(m)) and not _hooked(m)

    def forward(
        self,
        x: Tensor,
        inputs: AttentionInputs | MaskSpec | None = None,
        context: Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
        rows: slice | None = None,
    ) -> Tensor:
        """``x (B, Nq, D)`` → ``(B, Nq, D)``.

        ``inputs``: mask, RoPE angles, ALiBi and relative bias for this forward (or just a ``MaskSpec``),
        only read; with ``kernel_mask`` prepared for this kernel and shape, the mask is not rebuilt.
        ``context (B, Nk, D_ctx)``: the cross-attention source.
        ``layer``: this layer's index in its backbone: its KV cache entry, and its block layout where
        ``inputs`` has one per layer (``AttentionInputs.for_layer``).
        ``cache``: self-attention appends this forward's keys/values to ``layer``'s cache and attends
        over all of them; cross-attention projects ``context`` once, at the first call for ``layer``,
        and reuses those keys/values afterwards (``cache.cross``; the context must not change).
        ``rows``: only these query rows' outputs, ``(B, len(rows), D)``, equal to ``forward(x)[:, rows]``:
        keys and values still come from every row of ``x`` (a classifier reading its class token needs
        the last layer's attention for that row only; ``Backbone.forward(rows=…)``).

        Raises ``ValueError`` for ``rows`` with cross-attention, a cache, a kernel other than sdpa / eager,
        or a mask or score bias that differs between query rows (``AttentionInputs.rows_attend_alike``).
        """
        if inputs is None or isinstance(inputs, MaskSpec):  # a bare mask is enough for most uses
            inputs = AttentionInputs(mask=inputs or MaskSpec())
        inputs = inputs.for_layer(layer)  # this layer's block layout, when each layer has its own
        if rows is not None:
            self._check_rows(x, inputs, context, cache)
        if self.cross:
            if context is None:
                raise ValueError("cross-attention needs a context")
            inputs = inputs.for_context()  # no causality, RoPE or ALiBi across sequences
        q, k, v = self._project(x, context, cache, layer, rows)  # q: (B, H, len(rows), Dh) with rows
        if inputs.rope is not None and not self.cross:
            cos, sin = inputs.rope
            k = RotaryEmbedding.apply(k, cos, sin)
            if rows is not None:  # the rows' queries rotated at their own positions
                cos, sin = cos[:, :, rows], sin[:, :, rows]
            q = RotaryEmbedding.apply(q, cos, sin)
        B, Nq = x.shape[0], q.shape[2]
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

    def _check_rows(
        self, x: Tensor, inputs: AttentionInputs, context: Tensor | None, cache: KVCache | None
    ) -> None:
        if self.cross or context is not None or cache is not None:
            raise ValueError("rows= is for self-attention without a KV cache")
        if not inputs.rows_attend_alike():
            raise ValueError(
                "rows= needs a mask and score bias that are the same for every query row (padding at most): "
                "causal, document, window, block-sparse masks and ALiBi / relative biases depend on the row"
            )
        kernel = self.resolve_kernel(x, inputs)
        if kernel not in ("sdpa", "eager"):
            raise ValueError(f"rows= needs the sdpa or eager kernel, not {kernel!r}")

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
        if kernel in KERNEL_CLASSES:  # a registered kernel (nn/kernels): the mask rule is all it reads
            self.kernel_module.check(mask)
            if inputs.alibi_slopes is not None or inputs.rel_table is not None:
                raise ValueError(
                    f"the {kernel} kernel takes no score bias (ALiBi, T5 / Toeplitz relative positions): "
                    "use positions rope or none with it, or a softmax kernel (eager, sdpa, flex)"
                )
            if self.n_kv_heads != self.n_heads:
                k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for t in (k, v))
            return self.kernel_module(q, k, v, mask)
        prepared = inputs.kernel_mask
        if prepared is None or kernel not in prepared.kernels or (prepared.n_q, prepared.n_k) != (Nq, Nk):
            # a layer used alone (not from a backbone's forward): build this call's forms itself
            bias = _score_bias(inputs) if kernel in ("eager", "sdpa") else None
            prepared = _kernel_mask(mask, bias, {kernel}, Nq, Nk, q.shape[0], q.device)
        if kernel == "flex":
            if dropout_p > 0.0:
                raise ValueError("the flex kernel has no attention dropout; use sdpa or eager")
            return flex_attention(q, k, v, prepared.block_mask, self._score_mod(inputs))
        bias, dense, empty_rows = prepared.bias, prepared.dense, prepared.empty_rows
        if kernel == "sdpa" and prepared.gather is not None:  # BigBird's blocks gathered: linear in length
            if self.n_kv_heads != self.n_heads:
                k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for t in (k, v))
            with self._sdpa_context(q):
                return block_sparse_attention(q, k, v, mask, dropout_p, prepared.gather)
        if kernel == "eager":
            if self.n_kv_heads != self.n_heads:  # GQA: each group of H / Hkv query heads shares a kv head
                k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for t in (k, v))
            return eager_attention(q, k, v, dense, bias, dropout_p)
        # a branch, not the expression: with symbolic sizes (a compiled decoding step) Nq == Nk is a SymBool,
        # which sdpa's is_causal refuses; a branch makes dynamo decide it (with a guard)
        fast_causal = True if _decoding_mask(mask, Nk).is_causal_only and Nq == Nk and bias is None else False
        attn_mask = None if fast_causal else dense  # (a dense mask may be there for an eager layer)
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
        if empty_rows is not None and not fast_causal:
            out = out.masked_fill(empty_rows, 0.0)
        return out

    def _performer(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec) -> Tensor:
        """FAVOR+ (``nn.linear_attention``): causal or not, with padding; no documents, spans or windows."""
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
        features = getattr(self, "_features", None)  # drawn at the first call (none for other kernels)
        if features is None or features.shape != (self.performer_features, self.head_dim):
            generator = torch.Generator().manual_seed(0)  # fixed features: the same function in eval
            self._features = features = orthogonal_features(self.performer_features, self.head_dim, generator)
        if self.n_kv_heads != self.n_heads:
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for t in (k, v))
        return favor_attention(q, k, v, features, mask.causal, mask.valid)

    def attention_flops(
        self, batch: int, n_queries: int, n_keys: int, causal: bool, pairs: float | None = None
    ) -> int:
        """Forward FLOPs of this layer's kernel for ``batch`` sequences of ``n_queries`` queries against
        ``n_keys`` keys (causal or not), between the projections: matmuls only, 1 FLOP = a multiply or
        an add, as ``FlopCounterMode`` counts them (``AttentionKernel.flops``). A registered kernel counts
        its own (``kernel_module.flops``); the Performer its FAVOR+ products (``favor_flops``:
        ``performer_features`` features per head); the softmax kernels ``4 · B · H · Nq · Nk · Dh``
        (``softmax_flops``, the full ``Nq × Nk`` as eager computes it, causal or not), or with
        ``pairs`` — the query-key pairs per head a BigBird layout reads (``block_sparse.layout_pairs``) —
        ``4 · B · H · pairs · Dh`` for sdpa and flex, which compute only those blocks (sdpa where it
        gathers; flex in its own 128-token blocks); eager computes all ``Nq × Nk`` and counts them."""
        if self.kernel in KERNEL_CLASSES:
            return self.kernel_module.flops(batch, n_queries, n_keys, causal)
        H, Dh = self.n_heads, self.head_dim
        if self.kernel == "performer":
            return favor_flops(batch, H, n_queries, n_keys, Dh, self.performer_features, causal)
        if pairs is not None and self.kernel != "eager":
            return round(4 * batch * H * pairs * Dh)
        return softmax_flops(batch, H, n_queries, n_keys, Dh)

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
