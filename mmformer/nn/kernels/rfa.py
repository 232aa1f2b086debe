"""Random Feature Attention, RFA and RFA-Gate (Peng et al. 2021, "Random Feature Attention", ICLR,
arXiv:2103.02143, §2.2 and §3; random Fourier features: Rahimi & Recht 2007). No reference code was
released with the paper; this follows its equations.

The estimator, exactly (RFA Eq. 2–5). With frequencies ``w_1 … w_D`` drawn once,

    φ(x) = √(1/D) [sin(w_1·x), …, sin(w_D·x), cos(w_1·x), …, cos(w_D·x)]        (2D features)

gives ``φ(x)·φ(y) = (1/D) Σ_i cos(w_i·(x − y))``, an unbiased estimate of the Gaussian kernel
``exp(−‖x − y‖² / 2σ²)`` when ``w_i ~ N(0, σ⁻² I)`` (Bochner: ``E cos(w·δ) = exp(−s²‖δ‖²/2)`` for
``w ~ N(0, s² I)``). The paper writes ``w_i ~ N(0, σ² I)`` next to the kernel ``exp(−‖x−y‖²/2σ²)``; the two
agree only at σ = 1, and the kernel is the one attention needs, so the frequencies here have standard
deviation ``1/σ``. Then (Eq. 4–5)

    exp(x·y / σ²) = exp(‖x‖²/2σ² + ‖y‖²/2σ²) · exp(−‖x − y‖² / 2σ²)

and RFA ℓ2-normalises queries and keys (§3.1), so the norm correction ``exp(‖q̂‖²/2σ² + ‖k̂‖²/2σ²)`` is the
constant ``exp(1/σ²)``: it cancels between numerator and denominator and is not computed (multiplying it
in would only overflow for small σ). What RFA estimates is therefore softmax attention over the
normalised queries and keys at temperature σ, weights ``∝ exp(q̂·k̂ / σ²)`` (tested to converge as D grows):

    RFA(q, {k_i}, {v_i}) = φ(q̂)ᵀ Σ_i φ(k̂_i) v_iᵀ / φ(q̂)·Σ_j φ(k̂_j)

Causal attention uses prefix sums, computed chunkwise as ``nn.linear_attention`` does (a ``C × C`` product
inside each chunk, one running state across chunks). Unlike FAVOR+'s positive features, sine/cosine
features can make the denominator small or negative for a query whose few keys are far from it (small
σ, few features): the estimate is unbiased but not bounded.

RFA-Gate (§3.2, causal only): a scalar gate per head and step ``g_t = sigmoid(w_g·k_t + b_g)`` and

    S_t = g_t S_{t−1} + (1 − g_t) φ(k̂_t) v_tᵀ,   z_t = g_t z_{t−1} + (1 − g_t) φ(k̂_t),
    out_t = φ(q̂_t)ᵀ S_t / φ(q̂_t)·z_t

The paper's gate reads the layer input ``x_t``; a kernel sees only the per-head projections, so here it
reads the head's key ``k_t`` as projected (after RoPE / QK-norm, before the ℓ2-normalisation), itself
a learned linear function of ``x_t``. ``w_g (H, Dh)`` and ``b_g (H,)`` belong to the kernel module. Padded
steps neither decay nor write the state (``g = 1``). Chunkwise too: inside a chunk the decays are
``exp(A_t − A_i)`` with ``A`` the running sum of ``log g``; across chunks a loop over ``N / C`` states.

Not implemented from the paper: a learned σ and resampling the features at each training step (§3.1);
here the ``n_features`` frequencies are drawn once from ``seed`` (the same function in training and
eval, rebuilt identically on any device, not stored in checkpoints) and shared by the heads.

Shape legend: B batch, H heads, Nq queries, Nk keys (N when equal), Dh head width, D ``n_features``
(2D features per vector), C chunk length, n chunks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..linear_attention import linear_attention_flops
from ..masks import MaskSpec, require_bool
from . import AttentionKernel, register_kernel

CHUNK = 64  # tokens per chunk of the causal scan (``_causal_scan``)


def fourier_frequencies(n_features: int, dim: int, sigma: float = 1.0, seed: int = 0) -> Tensor:
    """``(n_features, dim)`` float32 frequencies ``w_i ~ N(0, σ⁻² I)``, i.i.d. (Rahimi & Recht), drawn from
    ``seed`` on the CPU: for them ``φ(x)·φ(y)`` estimates ``exp(−‖x − y‖² / 2σ²)``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n_features, dim, generator=generator) / sigma


def random_fourier_features(x: Tensor, w: Tensor) -> Tensor:
    """RFA Eq. 2: ``φ(x) = √(1/D) [sin(W x), cos(W x)]``, ``x (…, Dh)``, ``w (D, Dh)`` → ``(…, 2D)``."""
    proj = x @ w.T  # (..., D)
    return torch.cat([proj.sin(), proj.cos()], dim=-1) / math.sqrt(w.shape[0])


def rfa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w: Tensor,
    causal: bool = False,
    key_valid: Tensor | None = None,
    gate_logits: Tensor | None = None,
    chunk: int = CHUNK,
) -> Tensor:
    """RFA (module docstring): ``q (B, H, Nq, Dh)``, ``k, v (B, H, Nk, Dh)``, ``w (D, Dh)`` frequencies
    (``fourier_frequencies``); ``key_valid (B, Nk)`` bool, False keys are never read (their values may be
    anything, even NaN); ``gate_logits (B, H, N)`` — ``w_g·k_t + b_g`` — turns on RFA-Gate. Queries with no
    key to read (all padding) return zeros. Computed in float32; returns ``q.dtype``.

    Raises ``ValueError`` for causal attention with ``Nq != Nk`` or a gate without ``causal``,
    ``TypeError`` for a ``key_valid`` that is not bool.
    """
    dtype = q.dtype
    if gate_logits is not None and not causal:
        raise ValueError("RFA-Gate is a causal recurrence (S_t = g_t S_{t-1} + …): it needs a causal mask")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError("causal RFA needs as many queries as keys (no KV cache)")
    q, k, v, w = q.float(), k.float(), v.float(), w.float().to(q.device)
    qf = random_fourier_features(F.normalize(q, dim=-1), w)  # (B, H, Nq, 2D)
    kf = random_fourier_features(F.normalize(k, dim=-1), w)  # (B, H, Nk, 2D)
    log_g = None
    if gate_logits is not None:
        gate_logits = gate_logits.float()
        log_g = F.logsigmoid(gate_logits)  # log g_t, stable for large |logits|
        kf = kf * torch.sigmoid(-gate_logits).unsqueeze(-1)  # (1 − g_t) φ(k̂_t)
    if key_valid is not None:
        pad = ~require_bool(key_valid, "key_valid")[:, None, :, None]  # (B, 1, Nk, 1)
        kf, v = kf.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)  # a fill, not a product: 0·NaN is NaN
        if log_g is not None:
            log_g = log_g.masked_fill(pad[..., 0], 0.0)  # g = 1: a padded step leaves the state as it is
    if causal:
        num, den = _causal_scan(qf, kf, v, log_g, chunk)  # (B, H, N, Dh), (B, H, N, 1)
        has_key = None if key_valid is None else key_valid.cumsum(-1)[:, None, :, None] > 0
    else:
        num = qf @ (kf.transpose(-1, -2) @ v)  # (B, H, Nq, Dh)
        den = qf @ kf.sum(dim=-2).unsqueeze(-1)  # (B, H, Nq, 1)
        has_key = None if key_valid is None else key_valid.any(-1)[:, None, None, None]
    if has_key is not None:  # no key read: num = den = 0 exactly; divide by 1 (no NaN, nor in backward)
        den = torch.where(has_key, den, torch.ones_like(den))
    return (num / den).to(dtype)


def _causal_scan(
    qf: Tensor, kf: Tensor, v: Tensor, log_g: Tensor | None = None, chunk: int = CHUNK
) -> tuple[Tensor, Tensor]:
    """Numerator ``Σ_{i≤t} d_ti (φq_t·φk_i) v_i`` and denominator ``Σ_{i≤t} d_ti φq_t·φk_i`` for
    ``qf, kf (B, H, N, F)``, ``v (B, H, N, Dh)``, with decays ``d_ti = Π_{i<j≤t} g_j`` from ``log_g (B, H, N)``
    (``None``: all 1, plain prefix sums). Chunk by chunk (``nn.linear_attention._causal_chunked``, which
    divides inside and has no decay): within a chunk the causal ``C × C`` product, earlier chunks through
    their summed state. Padding to whole chunks adds zero features at the end, which add nothing."""
    B, H, N, _ = qf.shape
    C = min(chunk, N)
    pad = -N % C
    if pad:
        qf, kf, v = (F.pad(t, (0, 0, 0, pad)) for t in (qf, kf, v))
        log_g = None if log_g is None else F.pad(log_g, (0, pad))
    n = (N + pad) // C
    qc, kc, vc = (t.reshape(B, H, n, C, t.shape[-1]) for t in (qf, kf, v))  # (B, H, n, C, ·)
    scores = qc @ kc.transpose(-1, -2)  # (B, H, n, C, C)
    if log_g is None:
        scores = scores.tril()
        state = kc.transpose(-1, -2) @ vc  # (B, H, n, F, Dh): each chunk's φ(K)ᵀ V
        state = torch.cumsum(state, dim=2) - state  # the chunks before each chunk
        z = kc.sum(dim=-2)  # (B, H, n, F)
        z = torch.cumsum(z, dim=2) - z
        qd = qc
    else:
        a = log_g.reshape(B, H, n, C).cumsum(-1)  # (B, H, n, C): A_t, log of the decay since the chunk began
        causal = torch.ones(C, C, dtype=torch.bool, device=qf.device).tril()
        # (B, H, n, C, C): exp(A_t − A_i) for i ≤ t, the decay from step i to step t (≤ 1: no overflow)
        decay = (a.unsqueeze(-1) - a.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
        scores = scores * decay
        to_end = (a[..., -1:] - a).exp().unsqueeze(-1)  # (B, H, n, C, 1): from step i to the chunk's end
        chunk_kv = (kc * to_end).transpose(-1, -2) @ vc  # (B, H, n, F, Dh)
        chunk_z = (kc * to_end).sum(dim=-2)  # (B, H, n, F)
        through = a[..., -1].exp()  # (B, H, n): decay across a whole chunk
        s, s_z = torch.zeros_like(chunk_kv[:, :, 0]), torch.zeros_like(chunk_z[:, :, 0])  # S_0, z_0
        states, zs = [], []
        for c in range(n):  # the state entering each chunk: a recurrence over n = N / C chunks
            states.append(s)
            zs.append(s_z)
            s = through[:, :, c, None, None] * s + chunk_kv[:, :, c]
            s_z = through[:, :, c, None] * s_z + chunk_z[:, :, c]
        state, z = torch.stack(states, dim=2), torch.stack(zs, dim=2)  # (B, H, n, F, Dh), (B, H, n, F)
        qd = qc * a.exp().unsqueeze(-1)  # the entering state has decayed by exp(A_t) at step t
    num = scores @ vc + qd @ state  # (B, H, n, C, Dh)
    den = scores.sum(-1, keepdim=True) + (qd * z.unsqueeze(-2)).sum(-1, keepdim=True)  # (B, H, n, C, 1)
    return num.reshape(B, H, n * C, -1)[:, :, :N], den.reshape(B, H, n * C, 1)[:, :, :N]


@register_kernel
class RFAKernel(AttentionKernel):
    """Random Feature Attention as a kernel (module docstring): ``kernel="rfa"``.

    Options:
        n_features: ``D`` random frequencies (``2D`` features per query / key).
        sigma: the kernel width σ: RFA estimates softmax over ℓ2-normalised q, k with weights
            ``∝ exp(q̂·k̂ / σ²)``.
        gate: RFA-Gate (§3.2): learned ``gate_weight (H, Dh)``, ``gate_bias (H,)``; causal masks only.
        seed: seed of the frequencies (drawn once; the same function in eval and on any device).

    Raises ``ValueError`` for ``n_features < 1`` or ``sigma <= 0``; at forward, for a gate without a causal
    mask (and, through ``check``, for mask rules other than padding and causal).
    """

    name = "rfa"
    masks = frozenset({"padding", "causal"})

    def __init__(
        self,
        n_heads: int,
        head_dim: int,
        n_features: int = 128,
        sigma: float = 1.0,
        gate: bool = False,
        seed: int = 0,
    ):
        super().__init__(n_heads, head_dim)
        if n_features < 1:
            raise ValueError(f"rfa n_features must be >= 1, got {n_features}")
        if not sigma > 0:
            raise ValueError(f"rfa sigma must be > 0, got {sigma}")
        self.n_features, self.sigma, self.gate, self.seed = n_features, float(sigma), gate, seed
        self._frequencies: Tensor | None = None  # float32, not a buffer: no bf16 rounding, no meta tensor
        if gate:
            self.gate_weight = nn.Parameter(torch.empty(n_heads, head_dim))  # (H, Dh)
            self.gate_bias = nn.Parameter(torch.empty(n_heads))  # (H,)
            self.init_weights()

    @classmethod
    def needs(cls, options: dict) -> frozenset[str]:
        return frozenset({"causal"}) if options.get("gate") else frozenset()

    @classmethod
    def attends_across(cls, options: dict) -> bool:
        return not options.get("gate")  # the gate decays along one sequence's order

    def init_weights(self) -> None:
        """Gates start alike for every token (zero weight) at ``g = sigmoid(3) ≈ 0.95``: a recency window of
        ~20 tokens that training can widen or narrow (the paper gives no initialisation)."""
        if self.gate:
            nn.init.zeros_(self.gate_weight)
            nn.init.constant_(self.gate_bias, 3.0)

    def frequencies(self, device: torch.device) -> Tensor:
        """``(n_features, head_dim)`` float32 on ``device``, drawn from ``seed`` the first time."""
        w = self._frequencies
        if w is None or w.device != device:
            w = fourier_frequencies(self.n_features, self.head_dim, self.sigma, self.seed).to(device)
            self._frequencies = w
        return w

    def check(self, mask: MaskSpec) -> None:
        super().check(mask)
        if self.gate and not mask.causal:
            raise ValueError(
                "the rfa kernel with gate=True (RFA-Gate) is a causal recurrence: it needs a causal mask "
                "(use gate=False for bidirectional or cross-attention)"
            )

    def flops(self, batch: int, n_queries: int, n_keys: int, causal: bool) -> int:
        """Matmul FLOPs of ``forward`` (``AttentionKernel.flops``; RFA Eq. 2–5 and §3.2, as computed here):

        - the random projections ``x̂ Wᵀ`` of queries and keys (``random_fourier_features``, before sin
          and cos): ``2 · B · H · (Nq + Nk) · Dh · D``;
        - the products of the ``2D`` features with the values: ``linear_attention_flops`` (the same
          products as FAVOR+: ``φ(K)ᵀ V``, ``φ(Q)(·)`` and the normaliser; causal, ``_causal_scan``'s
          chunks of ``CHUNK`` tokens, whose decays when gated are elementwise);
        - RFA-Gate's logits ``w_g · k_t`` per head and step: ``2 · B · H · Nk · Dh``."""
        H, Dh, D = self.n_heads, self.head_dim, self.n_features
        projections = 2 * batch * H * (n_queries + n_keys) * Dh * D
        products = linear_attention_flops(batch * H, n_queries, n_keys, 2 * D, Dh, causal, CHUNK)
        gate = 2 * batch * H * n_keys * Dh if self.gate else 0
        return projections + products + gate

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec) -> Tensor:
        """``q (B, H, Nq, Dh)``, ``k, v (B, H, Nk, Dh)`` → ``(B, H, Nq, Dh)`` (see ``rfa_attention``)."""
        self.check(mask)
        logits = None
        if self.gate:  # reads each head's key as projected (module docstring)
            logits = torch.einsum("bhnd,hd->bhn", k.float(), self.gate_weight.float())
            logits = logits + self.gate_bias.float()[:, None]  # (B, H, N)
        return rfa_attention(q, k, v, self.frequencies(q.device), mask.causal, mask.valid, logits)
