"""Attention-Free Transformer kernels (Zhai et al. 2021, "An Attention Free Transformer", arXiv:2105.14103,
§3; AFT-full, AFT-local and AFT-simple — AFT-conv is not here).

AFT drops the query–key dot product: every channel takes its own weighted average of the values, with
weights set by the keys and learned pairwise position biases ``w``, and the query gates the result:

    Y_t = σ(Q_t) ⊙ Σ_{t'} exp(K_{t'} + w_{t,t'}) ⊙ V_{t'} / Σ_{t'} exp(K_{t'} + w_{t,t'})

(``⊙`` elementwise; the sums run over the keys the mask allows). Each channel is on its own (the paper
reads AFT as attention with one head per channel), so the layer's split into ``H`` heads of ``Dh``
channels changes nothing: ``w`` is one matrix shared by every channel of every head.

  * ``aft_full`` — ``w ∈ R^{T×T}`` for ``T = max_len`` positions; computed in the paper's form
    ``exp(w) @ (exp(K) ⊙ V)``: no ``(B, H, N, N)`` tensor, memory ``O(T² + B·H·N·Dh)``.
  * ``aft_local`` — ``w_{t,t'}`` learned for ``|t − t'| < window`` and 0 outside (the paper's AFT-local):
    a far key still counts, with weight ``exp(K_{t'})`` — this is not a sliding-window mask. Memory and
    time linear in ``N``: the band blockwise, the keys outside it through prefix / suffix sums.
  * ``aft_simple`` — no position biases: ``Y_t = σ(Q_t) ⊙ Σ_{t'} softmax_{t'}(K)_{t'} ⊙ V_{t'}``,
    memory ``O(B·H·N·Dh)``.

Masks (``MaskSpec``, True = may attend): ``padding`` (a padded key leaves both sums) and ``causal`` (the
sums stop at ``t' ≤ t``). A row with no key it may read gives zeros.

Numerics: computed in float32 (float64 stays float64), returned in the query's dtype. ``exp(K)`` is taken
relative to each channel's max over the real keys and ``exp(w)`` relative to each row's max: both cancel
in the ratio and are detached. In ``aft_full`` / ``aft_local`` with ``causal`` that channel max spans the
whole sequence, so a row whose visible keys all sit ~80 (float32's exponent range) below a later key in
some channel would divide 0 by 0 and give NaN (loudly, not a wrong number); keys of ordinary size (|K| of
a few units) are far from it. ``aft_simple``'s causal sums run in log space (``logcumsumexp``): no overflow
or underflow for keys of any size, rounding ~eps·|K|.

Shape legend: B batch, H heads, Nq queries, Nk keys (N when they are the same tokens), Dh head width,
T ``max_len``, s ``window``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..masks import MaskSpec
from . import AttentionKernel, register_kernel


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _require(name: str, **options: int | None) -> None:
    """Raises ``ValueError`` for a required option left out or below 1 (clearer than a missing-argument
    ``TypeError`` from a recipe's ``kernel_options``)."""
    for key, value in options.items():
        if value is None:
            raise ValueError(f"kernel {name!r} needs the option {key!r} (kernel_options={{{key!r}: ...}})")
        if value < 1:
            raise ValueError(f"kernel {name!r} needs {key} >= 1, got {value}")


def _check_shapes(name: str, q: Tensor, k: Tensor, mask: MaskSpec, max_len: int | None = None) -> None:
    """Raises ``ValueError`` for a causal mask over a different number of queries and keys, or for more
    tokens than ``max_len`` position biases."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    if mask.causal and n_q != n_k:
        raise ValueError(f"causal {name} needs as many queries as keys (no KV cache): got {n_q} and {n_k}")
    if max_len is not None and max(n_q, n_k) > max_len:
        raise ValueError(
            f"{name} holds position biases for max_len={max_len} tokens, got {max(n_q, n_k)}: "
            "raise its max_len option (recipes: model.backbone.kernel_options.max_len)"
        )


def _real_keys(k: Tensor, v: Tensor, mask: MaskSpec) -> tuple[Tensor, Tensor, Tensor | None]:
    """``k, v`` with padded keys set to 0 before any arithmetic (they may hold NaN, and 0·NaN is NaN, in
    the backward too), and ``keep (B, 1, Nk, 1)`` bool (None without padding)."""
    if mask.valid is None:
        return k, v, None
    keep = mask.valid[:, None, :, None]
    return k.masked_fill(~keep, 0.0), v.masked_fill(~keep, 0.0), keep


def _key_max(k: Tensor, keep: Tensor | None) -> Tensor:
    """``(B, H, 1, Dh)``: each channel's max over the real keys (0 where there are none), detached: it
    cancels between numerator and denominator."""
    if keep is not None:
        k = k.masked_fill(~keep, float("-inf"))
    top = k.amax(dim=-2, keepdim=True)
    return torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()


def _exp_keys(k: Tensor, v: Tensor, mask: MaskSpec) -> tuple[Tensor, Tensor]:
    """``exp(K − max)`` and ``exp(K − max) ⊙ V``, ``(B, H, Nk, Dh)`` each, 0 at padded keys."""
    k, v, keep = _real_keys(k, v, mask)
    ek = torch.exp(k - _key_max(k, keep))
    if keep is not None:
        ek = ek * keep
    return ek, ek * v


def _has_key(mask: MaskSpec, n_q: int) -> Tensor | None:
    """``(B, 1, Nq, 1)`` bool: the rows that may read at least one key (None: all of them)."""
    if mask.valid is None:
        return None
    seen = mask.valid.cumsum(-1) > 0 if mask.causal else mask.valid.any(-1, keepdim=True).expand(-1, n_q)
    return seen[:, None, :, None]


def _gate(q: Tensor, num: Tensor, den: Tensor, has: Tensor | None) -> Tensor:
    """``σ(Q) ⊙ num / den``. A row without keys has ``num = den = 0``: its ``den`` becomes 1 before the
    division (no NaN in the backward either), so it gives 0."""
    if has is not None:
        den = den.masked_fill(~has, 1.0)
    return torch.sigmoid(q) * num / den


@register_kernel
class AFTFull(AttentionKernel):
    """AFT-full (arXiv:2105.14103 §3): learned pairwise position biases ``pos_bias (T, T)``, row = query
    position, column = key position, shared by all channels, zero at init (every position weighs the
    same: AFT-simple). ``forward(q, k, v, mask)``: ``q (B, H, Nq, Dh)``, ``k, v (B, H, Nk, Dh)`` float, mask
    rules ``padding`` and ``causal`` (True = may attend) → ``(B, H, Nq, Dh)`` in ``q``'s dtype. Memory
    ``O(T² + B·H·N·Dh)``: ``exp(w) @ (exp(K) ⊙ V)``, never a ``(B, H, N, N)`` tensor.

    Raises ``ValueError`` for ``max_len`` missing or below 1; in ``forward`` for more than ``max_len``
    queries or keys, or a causal mask with ``Nq != Nk``.
    """

    name = "aft_full"
    masks = frozenset({"padding", "causal"})

    @classmethod
    def attends_across(cls, options: dict) -> bool:
        return True

    def __init__(self, n_heads: int, head_dim: int, max_len: int | None = None):
        super().__init__(n_heads, head_dim)
        _require(self.name, max_len=max_len)
        self.max_len = max_len
        self.pos_bias = nn.Parameter(torch.zeros(max_len, max_len))  # w[t, t']

    def init_weights(self) -> None:
        nn.init.zeros_(self.pos_bias)  # all positions alike at the start

    def flops(self, batch: int, n_queries: int, n_keys: int, causal: bool) -> int:
        """Matmul FLOPs of ``forward`` (``AttentionKernel.flops``): ``exp(w) @ (exp(K) ⊙ V)`` and
        ``exp(w) @ exp(K)``, ``(Nq, Nk)`` against ``(B, H, Nk, Dh)``, ``2 · B · H · Nq · Nk · Dh`` each
        (arXiv:2105.14103 §3, Eq. 2, as computed here; causal or not: the mask only sets ``w``): the
        same ``4 · B · H · Nq · Nk · Dh`` as softmax attention's two products."""
        return 4 * batch * self.n_heads * n_queries * n_keys * self.head_dim

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec) -> Tensor:
        _check_shapes(self.name, q, k, mask, self.max_len)
        dtype, n_q, n_k = _compute_dtype(q), q.shape[-2], k.shape[-2]
        out_dtype, q, k, v = q.dtype, q.to(dtype), k.to(dtype), v.to(dtype)
        w = self.pos_bias[:n_q, :n_k].to(dtype)  # (Nq, Nk)
        if mask.causal:  # -inf before exp: exp(-inf) = 0 with a zero gradient
            later = torch.ones(n_q, n_k, dtype=torch.bool, device=w.device).triu(1)
            w = w.masked_fill(later, float("-inf"))
        ew = torch.exp(w - w.amax(-1, keepdim=True).detach())  # (Nq, Nk), row max subtracted
        ek, ekv = _exp_keys(k, v, mask)  # (B, H, Nk, Dh)
        num, den = ew @ ekv, ew @ ek  # (B, H, Nq, Dh)
        return _gate(q, num, den, _has_key(mask, n_q)).to(out_dtype)


@register_kernel
class AFTLocal(AttentionKernel):
    """AFT-local (arXiv:2105.14103 §3): ``w_{t,t'}`` learned for ``|t − t'| < window``, 0 outside, exactly
    as the paper: keys outside the window still count, with weight ``exp(K_{t'})`` (not a sliding-window
    mask). The biases are stored as their band, ``pos_bias (T, 2·window − 1)`` with ``pos_bias[t, t' − t +
    window − 1] = w_{t,t'}``, zero at init. ``forward(q, k, v, mask)``: ``q, k, v (B, H, N, Dh)`` float
    (self-attention only), mask rules ``padding`` and ``causal`` (True = may attend) → ``(B, H, N, Dh)`` in
    ``q``'s dtype.

    The band runs blockwise: blocks of ``b = min(window, N)`` queries against their ``b + 2r`` neighbouring
    keys (``r = min(window, N) − 1``), one batched matmul; the keys beyond the band enter through prefix
    and suffix sums. Memory ``O(B·H·N·Dh + N·window)`` (about 3× the keys, plus the band of biases), time
    ``O(B·H·N·window·Dh)``.

    Raises ``ValueError`` for ``max_len`` or ``window`` missing or below 1, or ``window > max_len``; in
    ``forward`` for more than ``max_len`` tokens or ``Nq != Nk``.
    """

    name = "aft_local"
    masks = frozenset({"padding", "causal"})

    def __init__(self, n_heads: int, head_dim: int, max_len: int | None = None, window: int | None = None):
        super().__init__(n_heads, head_dim)
        _require(self.name, max_len=max_len, window=window)
        if window > max_len:
            raise ValueError(
                f"aft_local: window={window} is wider than max_len={max_len} (a window of max_len already "
                "covers every pair of positions): lower window, or use aft_full"
            )
        self.max_len, self.window = max_len, window
        self.pos_bias = nn.Parameter(torch.zeros(max_len, 2 * window - 1))  # w[t, t' − t + s − 1]

    def init_weights(self) -> None:
        nn.init.zeros_(self.pos_bias)  # all positions alike at the start

    def flops(self, batch: int, n_queries: int, n_keys: int, causal: bool) -> int:
        """Matmul FLOPs of ``forward`` over ``N = n_queries`` tokens (``AttentionKernel.flops``): the band
        (``_band``) for the numerator and the denominator, each ``n = ⌈N / b⌉`` blocks of ``b = min(window,
        N)`` queries against ``b + 2r`` keys (``r = b − 1``), ``2 · B · H · n · b · (b + 2r) · Dh``; the
        keys beyond the band are cumulative sums (not counted). Causal or not: the mask only sets the
        band's biases. ``4 · B · H · n · b · (3b − 2) · Dh`` in all (arXiv:2105.14103 §3, AFT-local, as
        computed here)."""
        b = min(self.window, n_queries)
        n = -(-n_queries // b)
        return 4 * batch * self.n_heads * n * b * (3 * b - 2) * self.head_dim

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec) -> Tensor:
        _check_shapes(self.name, q, k, mask, self.max_len)
        if q.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"aft_local is self-attention only: got {q.shape[-2]} queries and {k.shape[-2]} keys"
            )
        dtype, N = _compute_dtype(q), q.shape[-2]
        out_dtype, q, k, v = q.dtype, q.to(dtype), k.to(dtype), v.to(dtype)
        w, far = self._band_biases(N, mask.causal, dtype)  # (n, b, b + 2r), (N, 1)
        top = w.amax(-1).reshape(-1)[:N, None]  # (N, 1): the row's largest bias in the band ...
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        top = torch.where(far, top.clamp_min(0.0), top).detach()  # ... or 0, the bias of the far keys
        n, b = w.shape[:2]
        ew = torch.exp(w - F.pad(top, (0, 0, 0, n * b - N)).view(n, b, 1))  # (n, b, b + 2r)
        ek, ekv = _exp_keys(k, v, mask)  # (B, H, N, Dh)
        num = self._band(ew, ekv) + torch.exp(-top) * self._beyond(ekv, mask.causal)
        den = self._band(ew, ek) + torch.exp(-top) * self._beyond(ek, mask.causal)
        return _gate(q, num, den, _has_key(mask, N)).to(out_dtype)

    def _band_biases(self, N: int, causal: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The band's biases per block, ``(n, b, b + 2r)``: query ``i·b + a`` against key ``i·b − r + c``,
        ``-inf`` outside the band, the sequence or (causal) the past; and ``far (N, 1)`` bool: rows with a
        key beyond the band."""
        s = self.window
        b, r = min(s, N), min(s, N) - 1
        n = -(-N // b)
        dev = self.pos_bias.device
        t = torch.arange(n * b, device=dev).view(n, b, 1)  # query positions
        tk = (torch.arange(n, device=dev) * b - r).view(n, 1, 1) + torch.arange(b + 2 * r, device=dev)
        d = tk - t  # (n, b, b + 2r): key offset t' − t
        inside = (d.abs() < s) & (tk >= 0) & (tk < N) & (t < N)
        if causal:
            inside &= d <= 0
        w = self.pos_bias.to(dtype)[t.clamp(max=N - 1), (d + s - 1).clamp(0, 2 * s - 2)]
        pos = torch.arange(N, device=dev)[:, None]
        far = pos >= s if causal else (pos >= s) | (pos + s < N)
        return w.masked_fill(~inside, float("-inf")), far

    def _band(self, ew: Tensor, x: Tensor) -> Tensor:
        """``Σ_{|t−t'|<s} exp(w_{t,t'} − top_t) x_{t'}`` for ``x (B, H, N, Dh)`` → ``(B, H, N, Dh)``."""
        n, b, width = ew.shape
        N, r = x.shape[-2], (width - b) // 2
        x = F.pad(x, (0, 0, r, n * b - N + r))  # (B, H, r + n·b + r, Dh)
        windows = x.unfold(-2, width, b).transpose(-1, -2)  # (B, H, n, b + 2r, Dh)
        return (ew @ windows).flatten(2, 3)[:, :, :N]  # (B, H, n, b, Dh) → (B, H, N, Dh)

    def _beyond(self, x: Tensor, causal: bool) -> Tensor:
        """``Σ_{t' ≤ t−s} x_{t'}`` (+ ``Σ_{t' ≥ t+s} x_{t'}`` unless causal), ``(B, H, N, Dh)``: each a
        cumulative sum of its own (a difference of two sums would cancel digits)."""
        s, N = self.window, x.shape[-2]
        out = F.pad(x.cumsum(-2), (0, 0, s, 0))[:, :, :N]  # (B, H, N, Dh): the prefix ending at t − s
        if not causal:
            suffix = x.flip(-2).cumsum(-2).flip(-2)  # Σ_{t' ≥ t}
            out = out + F.pad(suffix, (0, 0, 0, s))[:, :, s:]  # the suffix starting at t + s
        return out


@register_kernel
class AFTSimple(AttentionKernel):
    """AFT-simple (arXiv:2105.14103 §3): no position biases, ``Y_t = σ(Q_t) ⊙ Σ_{t'} softmax_{t'}(K)_{t'}
    ⊙ V_{t'}`` per channel; no parameters. ``forward(q, k, v, mask)``: ``q (B, H, Nq, Dh)``, ``k, v (B, H,
    Nk, Dh)`` float, mask rules ``padding`` and ``causal`` (True = may attend) → ``(B, H, Nq, Dh)`` in ``q``'s
    dtype. Memory ``O(B·H·N·Dh)``. Without ``causal`` one context vector serves every query; with it, the
    prefix sums run in log space (``logcumsumexp``): no overflow or underflow for keys of any size, and
    row ``t`` reads tokens ``≤ t`` only, stabilisers included.

    Raises ``ValueError`` in ``forward`` for a causal mask with ``Nq != Nk``.
    """

    name = "aft_simple"
    masks = frozenset({"padding", "causal"})

    @classmethod
    def attends_across(cls, options: dict) -> bool:
        return True

    def flops(self, batch: int, n_queries: int, n_keys: int, causal: bool) -> int:
        """0 (``AttentionKernel.flops``): AFT-simple multiplies no matrices — sums over the keys (prefix
        sums in log space when causal) and elementwise products (arXiv:2105.14103 §3, as computed
        here); its cost, ``O(B · H · N · Dh)``, is not in the matmul count."""
        return 0

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec) -> Tensor:
        _check_shapes(self.name, q, k, mask)
        dtype = _compute_dtype(q)
        out_dtype, q, k, v = q.dtype, q.to(dtype), k.to(dtype), v.to(dtype)
        has = _has_key(mask, q.shape[-2])
        if not mask.causal:
            ek, ekv = _exp_keys(k, v, mask)  # (B, H, Nk, Dh)
            return _gate(q, ekv.sum(-2, keepdim=True), ek.sum(-2, keepdim=True), has).to(out_dtype)
        return (torch.sigmoid(q) * _causal_average(k, v, mask)).to(out_dtype)


def _causal_average(k: Tensor, v: Tensor, mask: MaskSpec) -> Tensor:
    """``Σ_{t'≤t} softmax(K)_{t'} V_{t'}`` per channel, ``(B, H, N, Dh)``, 0 in rows without keys.

    In log space, as ``logcumsumexp``: ``log Σ exp(K)`` and ``log Σ exp(K) (1 + V±)`` for the positive and
    negative parts ``V = V+ − V−`` (``1 +`` keeps every log finite; the two 1s cancel). No statistic of the
    whole sequence enters, so row ``t`` is computed from tokens ``≤ t`` alone. A padded key becomes a huge
    finite negative key rather than ``-inf``, whose gradient in ``logcumsumexp`` is NaN: its ``exp`` is 0."""
    k, v, keep = _real_keys(k, v, mask)
    if keep is not None:
        k = k.masked_fill(~keep, -1e30)
    log_den = torch.logcumsumexp(k, dim=-2)
    pos = torch.logcumsumexp(k + v.clamp_min(0.0).log1p(), dim=-2)  # (B, H, N, Dh)
    neg = torch.logcumsumexp(k + (-v).clamp_min(0.0).log1p(), dim=-2)
    out = torch.exp(pos - log_den) - torch.exp(neg - log_den)
    has = _has_key(mask, k.shape[-2])
    return out if has is None else out.masked_fill(~has, 0.0)
