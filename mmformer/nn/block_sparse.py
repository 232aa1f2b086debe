"""Block-sparse softmax attention: only the key blocks a layout lets each query block read are gathered
and scored, so BigBird's cost is linear in length on any device (Zaheer et al. 2020, §2 and App. D; the
gather formulation of ``bigbird_block_sparse_attention`` in google-research/bigbird, which gathers each
query block's random key blocks per head).

The layout is a ``MaskSpec``'s ``sparse_layout``: ``(nb, nb)`` or ``(H, nb, nb)`` bool over blocks of
``sparse_block`` tokens (``masks.bigbird_layout``) — or, for a sliding window without one, the band of
blocks covering the window (``window_band``: Longformer's and Mistral's local attention, linear in length
the same way). Query blocks that read every key block in every head
(BigBird's global rows) attend to all keys at once; the others gather their ``C`` key blocks — ``C`` the
most any of them reads, shorter rows padded with masked slots — and attend to ``C × block`` keys. Inside
the gathered blocks the mask's token rules still apply (padding, causal order and spans, documents, a
window), evaluated by the same ``MaskSpec.allows`` the dense and flex masks are built from, so the result
equals softmax attention under the dense mask (``tests/nn/test_block_sparse.py``). Each group of rows is
attended by ``F.scaled_dot_product_attention`` with a mask over only its gathered keys (a fused kernel:
the weights are never stored for the backward), and memory is that of the gathered keys, values and
their mask: ``O(N · C · block)``. Fully masked query rows return zeros, as every kernel's. Which rows
gather which blocks depends on the layout alone: ``gather_plan`` reads it once on the host (memoised per
layout), and the attention then reads no tensor's values — no host sync per call on a GPU, and a
compiled block holds it in one graph.

Shape legend: B batch, H heads, N tokens, Dh head width, nb blocks, R query blocks gathered, C key blocks
per gathered row.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import MaskSpec


@dataclass(frozen=True)
class GatherPlan:
    """How ``block_sparse_attention`` computes one block layout, read from the layout alone: computed once
    per layout on the host (``gather_plan``, memoised), so the attention itself reads no tensor's values —
    no host synchronisation on a GPU, no graph break under ``torch.compile``.

    Attributes:
        full_rows: ``(G,)`` long, the query blocks every head reads whole (BigBird's global rows): they
            attend to all keys at once.
        rows: ``(R,)`` long, the other query blocks: they gather their key blocks.
        cols: ``(Hl, R, C)`` long, the key blocks each of ``rows`` reads in each layout head (``Hl`` 1 for
            a layout shared by every head); a row that reads fewer than ``C`` has filler slots.
        slot: ``(Hl, R, C)`` bool, which of ``cols`` are readable (False: filler, masked).
        n_full, n_rows, width: ``G``, ``R`` and ``C`` as Python ints.
        block, n_blocks: tokens per block and the blocks of the layout (``nb``, square).
        worth: the gathered rows read at most half of the key blocks — above that a dense mask costs no
            more, and ``gathers`` says no.
    """

    full_rows: Tensor
    rows: Tensor
    cols: Tensor
    slot: Tensor
    n_full: int
    n_rows: int
    width: int
    block: int
    n_blocks: int
    worth: bool


def gather_plan(mask: MaskSpec, n_q: int, n_k: int, device: torch.device | None = None) -> GatherPlan | None:
    """The ``GatherPlan`` by which ``block_sparse_attention`` computes ``mask`` for ``n_q`` queries and
    ``n_k`` keys, its tensors on ``device`` (default: the layout's; CPU for a window): its
    ``sparse_layout``'s, or — a sliding window without one — that of the band of blocks covering the
    window (``window_band``). None where it cannot: neither, a per-layer layout (take
    ``MaskSpec.for_layer`` first), a KV-cache offset, ``n_q != n_k``, a layout over other than the
    ``ceil(n_k / sparse_block)`` blocks the keys fill, or a causal window with bidirectional ``span``s
    (a span's queries read its later keys, however far: no band covers them).

    A window's plan is arithmetic on its size (cached; traced as such by ``torch.compile``). A layout's is
    read from it on the host once and memoised per layout tensor and version (the last 1,024: an in-place
    change to a layout is a new version); ``BigBirdConfig.layer_layouts``' are cached, so a backbone's
    layers plan once per length."""
    layout, block = mask.sparse_layout, mask.sparse_block
    if mask.q_offset or n_q != n_k:
        return None
    if layout is None:
        if mask.window is None or (mask.causal and mask.span is not None):
            return None
        block = window_block(mask.window)
        args = (mask.window, block, -(-n_k // block), mask.causal, torch.device(device or "cpu"))
        return _band_plan.__wrapped__(*args) if torch.compiler.is_compiling() else _band_plan(*args)
    if layout.dim() > 3 or not layout.shape[-2] == layout.shape[-1] == -(-n_k // block):
        return None  # per layer, or over more blocks than the keys fill: the dense mask reads its corner
    device = layout.device if device is None else torch.device(device)
    if torch.compiler.is_compiling():  # traced without a prepared plan: reads the layout (a graph break)
        return _plan(layout, block, device)
    key = (layout.device, layout.untyped_storage().data_ptr(), layout.storage_offset(), layout.shape)
    key += (layout.stride(), layout._version, block, device)
    held = _PLANS.get(key)
    if held is None:  # the entry holds the layout: its storage, hence the key, cannot be reused meanwhile
        held = _PLANS[key] = (layout, _plan(layout, block, device))
        while len(_PLANS) > 1024:
            _PLANS.popitem(last=False)
    _PLANS.move_to_end(key)
    return held[1]


def window_block(window: int) -> int:
    """Tokens per block of a sliding window's band (``window_band``): ``max(8, ceil(window / 2))``."""
    return max(8, -(-window // 2))


def window_band(
    window: int, n_tokens: int, causal: bool, device: torch.device | None = None
) -> tuple[Tensor, int]:
    """The block layout that covers a sliding window of ``window`` tokens over ``n_tokens``: blocks of
    ``block = window_block(window)`` tokens, each query block reading the ``ceil((window - 1) / block)``
    (at most 2) blocks before it, itself, and as many after it unless ``causal`` — every key any of its
    queries may read; the window's own rule masks the rest inside them. Returns ``((nb, nb) bool,
    block)``. A query then scores at most ``3 × block`` keys (causal: ~1.5 × window) or ``5 × block``
    (~2.5 × window), not ``n_tokens``."""
    block = window_block(window)
    nb, reach = -(-n_tokens // block), _reach(window, block)
    blocks = torch.arange(nb, device=device)
    offset = blocks[:, None] - blocks[None, :]  # query block - key block
    return (offset <= reach) & (offset >= (0 if causal else -reach)), block


def gathers(mask: MaskSpec, n_q: int, n_k: int) -> bool:
    """Whether ``block_sparse_attention`` computes ``mask`` for ``n_q`` queries and ``n_k`` keys and it
    pays: a ``gather_plan`` exists and its gathered rows read at most half of the key blocks."""
    plan = gather_plan(mask, n_q, n_k)
    return plan is not None and plan.worth


def block_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, dropout_p: float = 0.0, plan: GatherPlan | None = None
) -> Tensor:
    """Softmax attention of ``q, k, v (B, H, N, Dh)`` under ``mask`` (a ``sparse_layout`` or a sliding
    ``window``, ``q_offset`` 0, as many queries as keys) → ``(B, H, N, Dh)``, computing only the key
    blocks the layout (or the window's band, ``window_band``) allows. ``dropout_p``: dropout on the
    attention weights. Scores are scaled by ``Dh ** -0.5``. ``plan``: the mask's ``gather_plan``
    (``KernelMask.gather`` holds it for a backbone's layers); found (memoised) when None.

    Raises ``ValueError`` for a mask with neither a layout nor a window, a KV-cache offset, ``N`` other
    than the layout's ``nb`` blocks cover (``ceil(N / sparse_block) == nb``), or a causal window with
    spans (``gather_plan`` None)."""
    B, H, N, Dh = q.shape
    if (
        (mask.sparse_layout is None and mask.window is None)
        or mask.q_offset
        or k.shape[2] != N
        or v.shape[2] != N
    ):
        raise ValueError(
            "block_sparse_attention needs a sparse_layout or a window, no KV-cache offset and Nq == Nk"
        )
    plan = plan if plan is not None else gather_plan(mask, N, N, q.device)
    if plan is None and mask.sparse_layout is not None:
        layout, block = mask.sparse_layout, mask.sparse_block
        raise ValueError(
            f"a layout of {tuple(layout.shape[-2:])} blocks of {block} tokens does not cover {N} tokens "
            "(or holds one per layer: take MaskSpec.for_layer first)"
        )
    if plan is None:
        raise ValueError(
            "no band of blocks covers this mask (a causal window with bidirectional spans reads a span's later "
            "keys, however far): use attention under its dense mask"
        )
    nb, block = plan.n_blocks, plan.block
    if -(-N // block) != nb:
        raise ValueError(f"a plan of {nb} blocks of {block} tokens does not cover {N} tokens")
    pad = nb * block - N
    if pad:  # a partial last block: padded keys are masked below, padded queries dropped at the end
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    qb, kb, vb = (t.reshape(B, H, nb, block, Dh) for t in (q, k, v))
    rule = replace(mask, sparse_layout=None, sparse_block=0)  # the token rules; blocks come from the gather
    if plan.n_rows == nb:  # every query block gathers (a window's band): no rows to place
        return _gathered(qb, kb, vb, plan, rule, N, dropout_p).reshape(B, H, nb * block, Dh)[:, :, :N]
    out = q.new_zeros(B, H, nb, block, Dh)
    if plan.n_full:
        out = out.index_copy(2, plan.full_rows, _all_keys(qb, k, v, plan, rule, N, dropout_p))
    if plan.n_rows:
        out = out.index_copy(2, plan.rows, _gathered(qb, kb, vb, plan, rule, N, dropout_p))
    return out.reshape(B, H, nb * block, Dh)[:, :, :N]


def layout_pairs(layout: Tensor, block: int, n_q: int, n_k: int) -> float:
    """Query-key token pairs per head that a block ``layout`` (``(nb, nb)`` or ``(H, nb, nb)``, blocks of
    ``block`` tokens over ``n_k`` keys, the last block possibly partial) lets the last ``n_q`` of them
    read, averaged over heads: what a block-sparse kernel scores, in place of ``n_q × n_k``
    (``Attention.attention_flops``)."""
    layout = _as_heads(layout).float()
    nb = layout.shape[-1]
    ends = torch.arange(1, nb + 1) * block
    k_sizes = (ends.clamp(max=n_k) - (ends - block)).clamp(min=0).float()  # (nb,) keys per block
    q_sizes = (ends.clamp(max=n_k) - (ends - block).clamp(min=n_k - n_q)).clamp(min=0).float()  # queries
    return float((layout.cpu() * q_sizes[:, None] * k_sizes[None, :]).sum((-1, -2)).mean())


def _as_heads(layout: Tensor) -> Tensor:
    return layout if layout.dim() == 3 else layout[None]


_PLANS: OrderedDict[tuple, tuple[Tensor, GatherPlan]] = OrderedDict()


def _plan(layout: Tensor, block: int, device: torch.device) -> GatherPlan:
    """``gather_plan``'s computation for a layout, on the host (one read of it), its tensors on
    ``device``."""
    layout = _as_heads(layout).cpu()  # (Hl, nb, nb)
    nb = layout.shape[-1]
    counts = layout.sum(-1)  # (Hl, nb)
    full = (counts == nb).all(0)  # (nb,) rows every head reads whole
    full_rows, rows = full.nonzero().flatten(), (~full).nonzero().flatten()
    reads = layout[:, rows]  # (Hl, R, nb)
    width = int(reads.sum(-1).max()) if len(rows) else 0
    # each row's readable blocks first (a stable sort keeps them in order), then masked filler slots
    cols = torch.argsort((~reads).to(torch.uint8), dim=-1, stable=True)[..., :width]  # (Hl, R, C)
    slot = torch.gather(reads, -1, cols)
    return GatherPlan(
        *(t.to(device) for t in (full_rows, rows, cols, slot)),
        n_full=len(full_rows),
        n_rows=len(rows),
        width=width,
        block=block,
        n_blocks=nb,
        worth=len(rows) > 0 and 2 * width <= nb,
    )


def _reach(window: int, block: int) -> int:
    return -(-(window - 1) // block)  # blocks on each side holding keys within the window


@functools.lru_cache(maxsize=64)
def _band_plan(window: int, block: int, nb: int, causal: bool, device: torch.device) -> GatherPlan:
    """A window's band as a ``GatherPlan``, from its sizes alone: every query block gathers the
    ``width`` blocks from ``reach`` before it (to ``reach`` after it unless causal); those outside the
    sequence are filler (``slot`` False, pointing at block 0 or ``nb - 1``)."""
    reach = _reach(window, block)
    width = reach + 1 if causal else 2 * reach + 1  # may exceed nb (then not worth it): filler slots
    rows = torch.arange(nb, device=device)
    cols = rows[:, None] - reach + torch.arange(width, device=device)  # (nb, C), may run past either end
    slot = (cols >= 0) & (cols < nb)
    return GatherPlan(
        rows[:0],
        rows,
        cols.clamp(0, nb - 1)[None],
        slot[None],
        n_full=0,
        n_rows=nb,
        width=width,
        block=block,
        n_blocks=nb,
        worth=2 * width <= nb,
    )


def _all_keys(
    qb: Tensor, k: Tensor, v: Tensor, plan: GatherPlan, rule: MaskSpec, n: int, dropout_p: float
) -> Tensor:
    """Query blocks ``plan.full_rows`` against every key: ``(B, H, G, block, Dh)``."""
    B, H, _, block, Dh = qb.shape
    rows = plan.full_rows
    qr = qb[:, :, rows].reshape(B, H, -1, Dh)  # (B, H, G·block, Dh)
    q_idx = (rows[:, None] * block + torch.arange(block, device=rows.device)).flatten()  # (G·block,)
    k_idx = torch.arange(k.shape[2], device=rows.device)
    allowed = _allowed(rule, q_idx[:, None], k_idx[None, :], None, n).unsqueeze(1)  # (B or 1, 1, G·block, Np)
    return _attend(qr, k, v, allowed, dropout_p).reshape(B, H, plan.n_full, block, Dh)


def _gathered(
    qb: Tensor, kb: Tensor, vb: Tensor, plan: GatherPlan, rule: MaskSpec, n: int, dropout_p: float
) -> Tensor:
    """Query blocks ``plan.rows`` against the key blocks they read: ``(B, H, R, block, Dh)``.

    A layout shared by every head (a window's band, a shared BigBird layout) is attended as ``B·R``
    problems of ``H`` heads, so that its mask — the same for every head — broadcasts over them (not one
    copy per head: the mask is most of the memory traffic at small head widths); a layout per head as
    ``B`` problems of ``H·R`` rows, its mask already one per head."""
    B, H, nb, block, Dh = qb.shape
    rows, cols, slot, R, C = plan.rows, plan.cols, plan.slot, plan.n_rows, plan.width
    shared = cols.shape[0] == 1  # Hl = 1
    # one index_select over (head, block) pairs gathers every head's blocks (its backward an index_add),
    # ordered (row, head, slot) when the heads share the layout, else (head, row, slot)
    heads = torch.arange(H, device=cols.device)[:, None, None] * nb
    flat = (heads.transpose(0, 1) + cols.transpose(0, 1) if shared else heads + cols).flatten()  # (H·R·C,)
    gathered = (B * R, H, C * block, Dh) if shared else (B, H * R, C * block, Dh)
    kg, vg = (t.reshape(B, H * nb, block * Dh).index_select(1, flat).view(gathered) for t in (kb, vb))
    offs = torch.arange(block, device=rows.device)
    q_idx = (rows[:, None] * block + offs)[None, :, :, None, None]  # (1, R, block, 1, 1)
    k_idx = (cols[..., None] * block + offs)[:, :, None]  # (Hl, R, 1, C, block)
    allowed = _allowed(rule, q_idx, k_idx, slot[:, :, None, :, None], n)  # (B|1, Hl, R, block|1, C, block)
    Bm, _, _, bq = allowed.shape[:4]  # bq = 1: no rule depends on the query (sdpa broadcasts the row)
    qr = qb if R == nb else qb[:, :, rows]  # (B, H, R, block, Dh); every block: no copy
    if shared:  # (B·R, H, ·): the mask (B·R, 1, ·) broadcasts over the heads
        allowed = allowed.reshape(Bm, R, 1, bq, C * block).expand(B, R, 1, bq, C * block)
        qr = qr.transpose(1, 2).reshape(B * R, H, block, Dh)
        out = _attend(qr, kg, vg, allowed.reshape(B * R, 1, bq, C * block), dropout_p)
        return out.view(B, R, H, block, Dh).transpose(1, 2)
    allowed = allowed.expand(Bm, H, R, bq, C, block).reshape(Bm, H * R, bq, C * block)
    out = _attend(qr.reshape(B, H * R, block, Dh), kg, vg, allowed, dropout_p)
    return out.view(B, H, R, block, Dh)


def _allowed(rule: MaskSpec, q_idx: Tensor, k_idx: Tensor, slot: Tensor | None, n: int) -> Tensor:
    """``rule`` on query / key token indices (broadcast; keys past ``n`` — a partial last block's padding —
    never read), ``slot`` (a gathered block's slots that are real, or None), with a leading batch axis
    ``(B or 1, …)``."""
    B = rule.batch_size or 1
    b = torch.arange(B, device=q_idx.device).view(B, *[1] * max(q_idx.dim(), k_idx.dim()))
    ok = rule.allows(b, q_idx.clamp(max=n - 1), k_idx.clamp(max=n - 1)) & (k_idx < n)
    if slot is not None:
        ok = ok & slot
    return ok if ok.dim() > k_idx.dim() else ok.unsqueeze(0)


def _attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, dropout_p: float) -> Tensor:
    """Softmax attention of ``q (B, …, Lq, Dh)`` over ``k, v (B, …, Lk, Dh)`` where ``allowed`` (broadcast
    to ``(B, …, Lq, Lk)``) — sdpa's fused kernel, which never stores the weights — with fully masked
    rows set to 0."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)
    return out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
