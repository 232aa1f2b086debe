"""Random-feature linear attention: Performer's FAVOR+ (Choromanski et al. 2021, "Rethinking Attention
with Performers", §2.3–2.4; the positive orthogonal random features of ``performer-pytorch``).

``softmax(q·k/√d)`` is estimated by ``φ(q)·φ(k)`` with ``φ(x) = exp(W x̃ − |x̃|²/2) / √m``,
``x̃ = x / d^{1/4}``, ``W`` ``m`` orthogonal Gaussian rows; attention becomes
``φ(Q) (φ(K)ᵀ V)`` normalised by ``φ(Q) (φ(K)ᵀ 1)`` — time and memory linear in the sequence
length. Causal attention needs prefix sums of ``φ(k)ᵀ v``; materialising one ``(m, Dh)`` state per token
costs ``N·m·Dh`` memory, so it runs chunkwise (the chunked form of linear attention, e.g. Yang et al.
2024, "Gated Linear Attention", §2.2): inside a chunk of ``C`` tokens the causal ``φ(Q)φ(K)ᵀ`` is a small
``C × C`` matrix, across chunks one running state per chunk — memory ``N·(C + m) + (N/C)·m·Dh``, the
same sums in another order. The estimate converges to softmax attention as ``m`` grows (tested).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .masks import require_bool

CHUNK = 64  # tokens per chunk of the causal products (``_causal_chunked``)


def orthogonal_features(n_features: int, dim: int, generator: torch.Generator | None = None) -> Tensor:
    """``(n_features, dim)``: stacked blocks of orthonormal rows (QR of Gaussian blocks), each row scaled
    by the norm of a Gaussian vector, so rows are marginally Gaussian but orthogonal within a block."""
    blocks = []
    for _ in range(math.ceil(n_features / dim)):
        q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=generator))
        blocks.append(q.T)
    w = torch.cat(blocks)[:n_features]
    norms = torch.randn(n_features, dim, generator=generator).norm(dim=1, keepdim=True)
    return w * norms


def _phi(x: Tensor, w: Tensor, is_query: bool) -> Tensor:
    """Positive random features ``(…, N, m)`` of ``x (…, N, d)``; a max is subtracted for stability
    (per query row; over all keys), which cancels in the normalisation."""
    x = x * x.shape[-1] ** -0.25
    proj = x @ w.T  # (..., N, m)
    sq = x.square().sum(-1, keepdim=True) / 2
    stab = proj.amax(dim=-1, keepdim=True) if is_query else proj.amax(dim=(-1, -2), keepdim=True)
    return (torch.exp(proj - sq - stab.detach()) + 1e-6) / math.sqrt(w.shape[0])


def favor_attention(
    q: Tensor, k: Tensor, v: Tensor, features: Tensor, causal: bool = False, key_valid: Tensor | None = None
) -> Tensor:
    """FAVOR+ attention. ``q (B, H, Nq, Dh)``, ``k, v (B, H, Nk, Dh)``, ``features (m, Dh)``; ``causal``
    needs ``Nq == Nk``; ``key_valid (B, Nk)`` bool drops padded keys. Computed in float32; returns
    ``q.dtype``. Raises ``ValueError`` for causal attention with ``Nq != Nk``, ``TypeError`` for a
    ``key_valid`` that is not bool."""
    dtype = q.dtype
    q, k, v, w = q.float(), k.float(), v.float(), features.float().to(q.device)
    if key_valid is not None:  # padded keys may hold anything: they must not set the stabilising max
        k = k.masked_fill(~require_bool(key_valid, "key_valid")[:, None, :, None], 0.0)
    qf, kf = _phi(q, w, True), _phi(k, w, False)  # (B, H, N, m)
    if key_valid is not None:
        kf = kf * key_valid[:, None, :, None].to(kf.dtype)
    if not causal:
        kv = kf.transpose(-1, -2) @ v  # (B, H, m, Dh)
        norm = qf @ kf.sum(dim=-2).unsqueeze(-1)  # (B, H, Nq, 1)
        return ((qf @ kv) / norm).to(dtype)
    if q.shape[-2] != k.shape[-2]:
        raise ValueError("causal random-feature attention needs as many queries as keys (no KV cache)")
    return _causal_chunked(qf, kf, v).to(dtype)


def _causal_chunked(qf: Tensor, kf: Tensor, v: Tensor, chunk: int = CHUNK) -> Tensor:
    """``Σ_{j≤i} (φq_i·φk_j) v_j / Σ_{j≤i} φq_i·φk_j`` for ``qf, kf (B, H, N, m)``, ``v (B, H, N, Dh)``,
    chunk by chunk: within a chunk the causal product directly, earlier chunks through their summed
    state ``φ(K)ᵀ V`` (exclusive prefix sum over chunks). Padding to whole chunks adds zero features,
    which add nothing."""
    B, H, N, m = qf.shape
    C = min(chunk, N)
    pad = -N % C
    if pad:
        qf, kf, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (qf, kf, v))
    n = (N + pad) // C
    qc, kc, vc = (t.reshape(B, H, n, C, t.shape[-1]) for t in (qf, kf, v))  # (B, H, n, C, ·)
    state = kc.transpose(-1, -2) @ vc  # (B, H, n, m, Dh): each chunk's φ(K)ᵀ V
    state = torch.cumsum(state, dim=2) - state  # the chunks before each chunk
    z = kc.sum(dim=-2)  # (B, H, n, m)
    z = torch.cumsum(z, dim=2) - z
    scores = (qc @ kc.transpose(-1, -2)).tril()  # (B, H, n, C, C): causal inside the chunk
    out = scores @ vc + qc @ state  # (B, H, n, C, Dh)
    norm = scores.sum(-1, keepdim=True) + (qc * z.unsqueeze(-2)).sum(-1, keepdim=True)
    return (out / norm).reshape(B, H, n * C, -1)[:, :, :N]


def favor_flops(
    batch: int, n_heads: int, n_queries: int, n_keys: int, head_dim: int, n_features: int, causal: bool
) -> int:
    """Matmul FLOPs of ``favor_attention`` (1 FLOP = a multiply or an add; elementwise ops and sums not
    counted): the feature maps ``x W^T`` of queries and keys (``_phi``: ``2 · B · H · (Nq + Nk) · Dh · m``)
    plus the products of the features (``linear_attention_flops``)."""
    features = 2 * batch * n_heads * (n_queries + n_keys) * head_dim * n_features
    return features + linear_attention_flops(batch * n_heads, n_queries, n_keys, n_features, head_dim, causal)


def linear_attention_flops(
    batch_heads: int,
    n_queries: int,
    n_keys: int,
    n_features: int,
    head_dim: int,
    causal: bool,
    chunk: int = CHUNK,
) -> int:
    """Matmul FLOPs of linear attention over features ``qf (BH, Nq, F)``, ``kf (BH, Nk, F)`` and values
    ``v (BH, Nk, Dh)``, ``BH`` = batch × heads, as ``favor_attention`` computes it (and RFA's
    ``rfa_attention``, which has the same products):

    - not causal: ``φ(K)ᵀ V`` and ``φ(Q) (φ(K)ᵀ V)``, ``2 · BH · N · F · Dh`` each, and the normaliser
      ``φ(Q) Σ φ(K)``, ``2 · BH · Nq · F``;
    - causal (``Nq = Nk = N``; ``_causal_chunked``): ``n = ⌈N / C⌉`` chunks of ``C = min(chunk, N)`` tokens,
      the last one zero-padded and computed in full: per chunk its state ``φ(K)ᵀ V`` (``2 · C · F · Dh``),
      the causal ``φ(Q) φ(K)ᵀ`` (``2 · C² · F``, computed square), its product with ``V`` (``2 · C² · Dh``)
      and ``φ(Q) · state`` (``2 · C · F · Dh``); the normaliser is sums (not counted)."""
    if causal:
        C = min(chunk, n_queries)
        n = -(-n_queries // C)
        return 2 * batch_heads * n * C * (2 * n_features * head_dim + C * n_features + C * head_dim)
    products = 2 * batch_heads * (n_keys + n_queries) * n_features * head_dim
    return products + 2 * batch_heads * n_queries * n_features
