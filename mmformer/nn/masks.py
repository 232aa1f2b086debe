"""Attention masks described as rules, turned into what each kernel needs.

Convention everywhere in mmformer: ``True`` = may attend / is real. Conversions to other
conventions (additive float masks, ``nn.MultiheadAttention``'s True = ignore) happen only here.
Masks are bool tensors: every helper here (and ``MaskSpec``) raises ``TypeError`` for another dtype
rather than convert it, since ``~`` of an integer 0/1 mask is a bitwise not (``~1 == -2``) and a float
mask may be additive (0 / -inf) as well as 0/1; pass ``mask.bool()`` for a 0/1 mask.

One rule function (``MaskSpec.allows``) decides whether query ``i`` may attend to key ``j``; the
same function, evaluated on index grids, gives the dense mask for ``eager`` / ``sdpa`` and, as a
``mask_mod``, the FlexAttention ``BlockMask`` — so every kernel sees exactly the same mask.

Rules (all optional, combined with AND):
  * ``causal`` — ``j <= i``; tokens that share a nonzero ``span`` id also see each other both ways
    (prefix-LM: the prefix is span 1; Transfusion: every image/audio span gets its own id).
  * ``window`` — sliding window: ``i - j < window`` (and ``j - i < window`` when not causal).
  * ``valid`` — padding keys are never attended.
  * ``document`` — tokens attend only within their packed document.
With a KV cache the ``Nq`` queries are the last ``Nq`` of the ``Nk`` keys (``q_offset = Nk - Nq``):
a query shorter than the keys is aligned to the end. Per-token tensors (``valid``, ``document``,
``span``) cover all ``Nk`` key positions.

Shape legend: B batch, Nq queries, Nk keys.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor


def require_bool(mask: Tensor, name: str = "mask") -> Tensor:
    """``mask`` itself when it is bool. Raises ``TypeError`` for any other dtype (see the module
    docstring: masks are never converted implicitly)."""
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a bool mask (True = real token / may attend), got {mask.dtype}: "
            f"pass {name}.bool() for a 0/1 mask"
        )
    return mask


@dataclass(frozen=True)
class MaskSpec:
    """Rules that decide whether query ``i`` may attend to key ``j`` (True = may attend).

    Attributes:
        causal: ``j <= i`` (except inside a shared ``span``).
        valid: optional ``(B, Nk)`` bool, keys that are real tokens.
        document: optional ``(B, Nk)`` long, packed-sequence ids.
        span: optional ``(B, Nk)`` long, bidirectional span ids (0 = none) inside a causal sequence.
        window: optional sliding-window size in tokens (>= 1).
        q_offset: position of the first query among the keys (KV-cache decoding).
        sparse_layout: optional ``(Nq blocks, Nk blocks)`` bool, which key blocks each query block may
            read (BigBird, ``bigbird_layout``), in blocks of ``sparse_block`` tokens; ``(H, Nq blocks,
            Nk blocks)`` for a layout of each head (``bigbird_layout(n_heads=H)``); ``(L, H, Nq blocks,
            Nk blocks)`` for one of each layer too, which ``for_layer`` picks before the rule is read.

    Raises ``TypeError`` when ``valid`` or ``sparse_layout`` is not bool (``require_bool``).
    """

    causal: bool = False
    valid: Tensor | None = None
    document: Tensor | None = None
    span: Tensor | None = None
    window: int | None = None
    q_offset: int = 0
    sparse_layout: Tensor | None = None
    sparse_block: int = 0

    def __post_init__(self) -> None:  # a dtype check only: no device sync
        if self.valid is not None:
            require_bool(self.valid, "valid")
        if self.sparse_layout is not None:
            require_bool(self.sparse_layout, "sparse_layout")

    @classmethod
    def from_tokens(
        cls,
        valid: Tensor,
        document: Tensor,
        causal: bool,
        span: Tensor | None = None,
        window: int | None = None,
        q_offset: int = 0,
        sparse_layout: Tensor | None = None,
        sparse_block: int = 0,
    ) -> MaskSpec:
        """Drop rules that allow everything, so kernels can take their fast path.

        The three checks (every token valid, one document, any span) are read from the device together:
        one host sync per forward. Raises ``TypeError`` when ``valid`` is not bool.
        """
        require_bool(valid, "valid")
        checks = [valid.all(), (document == document[:, :1]).all()]
        if causal and span is not None:
            checks.append((span > 0).any())
        all_valid, one_document, *any_span = torch.stack(checks).tolist()
        keep_valid = None if all_valid else valid
        keep_doc = None if one_document else document
        keep_span = span if any_span and any_span[0] else None
        return cls(
            causal=causal,
            valid=keep_valid,
            document=keep_doc,
            span=keep_span,
            window=window,
            q_offset=q_offset,
            sparse_layout=sparse_layout,
            sparse_block=sparse_block,
        )

    @property
    def is_full(self) -> bool:
        """Every query may attend to every key: no mask at all."""
        return (
            not self.causal
            and self.valid is None
            and self.document is None
            and self.window is None
            and self.sparse_layout is None
        )

    @property
    def same_for_every_query(self) -> bool:
        """Every query row may read the same keys (at most padding is hidden): a subset of the queries
        can then be attended alone with the same rule (``Attention.forward(rows=…)``)."""
        return (
            not self.causal and self.document is None and self.window is None and self.sparse_layout is None
        )

    @property
    def is_causal_only(self) -> bool:
        """Plain causal with queries = keys: kernels take ``is_causal=True`` instead of a mask."""
        return (
            self.causal
            and self.valid is None
            and self.document is None
            and self.span is None
            and self.window is None
            and self.sparse_layout is None
            and self.q_offset == 0
        )

    @property
    def batch_size(self) -> int | None:
        for t in (self.valid, self.document, self.span):
            if t is not None:
                return t.shape[0]
        return None

    @property
    def n_layout_heads(self) -> int:
        """Heads with a layout of their own: ``H`` for a per-head ``sparse_layout``, else 1."""
        layout = self.sparse_layout
        return layout.shape[-3] if layout is not None and layout.dim() >= 3 else 1

    @property
    def per_layer(self) -> bool:
        """The ``sparse_layout`` holds one layout per layer (``(L, H, nb, nb)``): see ``for_layer``."""
        return self.sparse_layout is not None and self.sparse_layout.dim() == 4

    def for_layer(self, layer: int) -> MaskSpec:
        """The rule of layer ``layer``: its own layout from a per-layer ``sparse_layout``; else this rule."""
        return replace(self, sparse_layout=self.sparse_layout[layer]) if self.per_layer else self

    def allows(self, b: Tensor, q: Tensor, k: Tensor, h: Tensor | None = None) -> Tensor:
        """The rule itself: bool, broadcast over the batch index ``b``, query index ``q`` (0-based among
        the queries), key index ``k`` and head index ``h`` (read only by a per-head ``sparse_layout``;
        None: head 0). Works on index grids (dense) and on FlexAttention's 0-d indices (``mask_mod``)."""
        qpos = q + self.q_offset
        ok = torch.ones((), dtype=torch.bool, device=q.device)
        if self.causal:
            seen = k <= qpos
            if self.span is not None:
                sq = self.span[b, qpos]
                seen = seen | ((sq > 0) & (sq == self.span[b, k]))
            ok = ok & seen
        if self.window is not None:
            ok = ok & (qpos - k < self.window)
            if not self.causal:
                ok = ok & (k - qpos < self.window)
        if self.valid is not None:
            ok = ok & self.valid[b, k]
        if self.document is not None:
            ok = ok & (self.document[b, qpos] == self.document[b, k])
        if self.sparse_layout is not None:
            blocks = (qpos // self.sparse_block, k // self.sparse_block)
            if self.per_layer:
                raise ValueError("a per-layer sparse_layout: take MaskSpec.for_layer(layer) first")
            if self.sparse_layout.dim() == 3:
                if h is None:
                    raise ValueError("a per-head sparse_layout needs the head index h")
                blocks = (h, *blocks)
            ok = ok & self.sparse_layout[blocks]
        return ok

    def dense(self, n_q: int, n_k: int | None = None, device: torch.device | None = None) -> Tensor:
        """The mask as a dense bool tensor ``(B or 1, H or 1, Nq, Nk)``, True = may attend (``H`` heads
        for a per-head ``sparse_layout``)."""
        n_k = n_q if n_k is None else n_k
        ref = next(
            (t for t in (self.valid, self.document, self.span, self.sparse_layout) if t is not None), None
        )
        device = ref.device if ref is not None else device
        B, H = self.batch_size or 1, self.n_layout_heads
        b = torch.arange(B, device=device).view(B, 1, 1, 1)
        h = torch.arange(H, device=device).view(1, H, 1, 1)
        q = torch.arange(n_q, device=device).view(1, 1, n_q, 1)
        k = torch.arange(n_k, device=device).view(1, 1, 1, n_k)
        return self.allows(b, q, k, h).expand(B, H, n_q, n_k)

    def block_mask(self, batch_size: int, n_q: int, n_k: int, device: torch.device):
        """The mask as a FlexAttention ``BlockMask`` (no dense ``Nq × Nk`` tensor is kept)."""
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q_idx, kv_idx):
            return self.allows(b, q_idx, kv_idx, h)

        B = self.batch_size or batch_size
        H = self.n_layout_heads if self.n_layout_heads > 1 else None  # None: one mask for every head
        # compiled construction on accelerators avoids materialising the dense Nq × Nk mask
        return create_block_mask(mask_mod, B, H, n_q, n_k, device=str(device), _compile=device.type == "cuda")


def bigbird_layout(
    n_blocks: int,
    window: int = 1,
    global_blocks: int = 1,
    random_blocks: int = 1,
    seed: int = 0,
    causal: bool = False,
    n_heads: int | None = None,
) -> Tensor:
    """BigBird's block-sparse pattern (Zaheer et al. 2020, §2 and App. D, "ITC"): ``(n_blocks, n_blocks)``
    bool, True where query block ``i`` may read key block ``j``: a band of ``window`` blocks on each
    side, ``global_blocks`` leading blocks that read and are read by every block, and ``random_blocks``
    other key blocks per query block drawn with ``seed``. Attention cost grows linearly with length.

    ``n_heads``: ``(n_heads, n_blocks, n_blocks)``, each head with random blocks of its own, as BigBird's
    code draws them (``bigbird_block_rand_mask_with_head`` in google-research/bigbird, one draw per head);
    the band and global blocks are every head's. None: one layout, ``(n_blocks, n_blocks)``.

    ``causal``: the random blocks are drawn among earlier blocks only, so each row's pattern does not
    depend on how many blocks follow it — a causal model computes the same function on a prefix as on
    the whole sequence (training and KV-cache decoding agree at every length). Without it the draws
    range over every block, as BigBird's bidirectional encoder does, and depend on ``n_blocks``."""
    i = torch.arange(n_blocks)
    band = (i[:, None] - i[None, :]).abs() <= window
    band[:global_blocks, :] = True
    band[:, :global_blocks] = True
    layout = band.expand(n_heads or 1, n_blocks, n_blocks).clone()
    g = torch.Generator().manual_seed(seed)
    for row in range(global_blocks, n_blocks):  # rows outer: a causal row's draws never depend on later rows
        for head in layout:
            free = (~head[row, : row if causal else n_blocks]).nonzero().flatten()
            if len(free):
                pick = free[torch.randperm(len(free), generator=g)[:random_blocks]]
                head[row, pick] = True
    return layout if n_heads is not None else layout[0]


def to_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask (True = may attend) → additive float mask (0 or the dtype's most negative value).
    Raises ``TypeError`` for a mask that is not bool."""
    require_bool(mask)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def to_ignore(mask: Tensor) -> Tensor:
    """Bool mask (True = may attend) → ``nn.MultiheadAttention`` convention (True = ignore).
    Raises ``TypeError`` for a mask that is not bool."""
    return ~require_bool(mask)
