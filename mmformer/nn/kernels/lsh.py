"""LSH attention: Reformer's locality-sensitive-hashing attention (Kitaev, Kaiser & Levskaya 2020, "Reformer:
The Efficient Transformer", arXiv:2001.04451, §3 "Locality-sensitive hashing attention" and App. A; reference
implementations: trax ``LSHSelfAttention`` and HF ``transformers``' ``LSHSelfAttention``).

Shared-QK: the keys are the queries, length-normalised, so a query and the keys it should read land in the same
hash bucket (§3, "LSH attention"). Each of ``n_hashes`` rounds hashes every token with angular LSH (Andoni et
al. 2015, arXiv:1509.02897: ``h(x) = argmax([xR; −xR])``, ``R`` a Gaussian ``(Dh, n_buckets/2)`` matrix, a fresh
one per round and head, drawn once from ``seed``), sorts the tokens by (bucket, position), cuts the sorted
sequence into chunks of ``chunk_size`` and lets every chunk attend within itself and to the chunk before it:
memory ``O(N · chunk_size)`` per round, never an ``N × N`` tensor. Rounds are combined by the weights of their
log-sum-exps, with the paper's ``− log N_ij`` for a key found in ``N_ij`` rounds (§3 "Multi-round LSH
attention", App. A), so the result is exactly softmax attention over the union of the rounds' chunks.

Shape legend: B batch, H heads, N tokens, Dh head width, R hash rounds (``n_hashes``), C chunk width
(``min(chunk_size, N)``), n chunks per round (``⌈N / C⌉``), Np = n·C tokens after padding, W = 2C keys per chunk.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..masks import MaskSpec
from . import AttentionKernel, register_kernel

# scores (float32, like HF's float32 values): a token's score for itself, read only when nothing else may be
# (§3 "Causal masking for shared-QK attention"), and a key the mask forbids, whose weight underflows to 0
SELF_SCORE = -1e5
MASKED_SCORE = -1e9


def hash_buckets(x: Tensor, rotations: Tensor) -> Tensor:
    """Angular-LSH buckets ``(B, H, R, N)`` long of ``x (B, H, N, Dh)``: ``argmax([xR; −xR])`` with
    ``rotations (R, H, Dh, n_buckets/2)``, one per round and head. Zero columns (``n_buckets = 1``): all 0."""
    B, H, N, _ = x.shape
    if rotations.shape[-1] == 0:
        return torch.zeros(B, H, rotations.shape[0], N, dtype=torch.long, device=x.device)
    rotated = torch.einsum("bhnd,rhdk->bhrnk", x, rotations)  # (B, H, R, N, n_buckets/2)
    return torch.cat([rotated, -rotated], dim=-1).argmax(dim=-1)


def sort_by_bucket(buckets: Tensor) -> tuple[Tensor, Tensor]:
    """``order, undo``, long, shaped like ``buckets (…, N)``: ``order`` lists the positions sorted by (bucket,
    position); ``undo`` is each position's rank in ``order``, so ``take(take(x, order), undo) == x``."""
    N = buckets.shape[-1]
    pos = torch.arange(N, device=buckets.device).expand_as(buckets)
    order = (buckets * N + pos).argsort(dim=-1)  # keys are unique: no stable sort needed
    undo = torch.empty_like(order).scatter_(-1, order, pos)
    return order, undo


def take(x: Tensor, index: Tensor) -> Tensor:
    """``x (B, H, R, N, D)`` at token indices ``index (B, H, R, M)`` → ``(B, H, R, M, D)``."""
    return x.gather(3, index.unsqueeze(-1).expand(*index.shape, x.shape[-1]))


def look_back(x: Tensor) -> Tensor:
    """Chunks ``(…, n, C, D)`` → ``(…, n, 2C, D)``: each chunk after the one before it. Chunk 0 gets the last
    chunk (a roll), which the caller masks: there is no wrap-around."""
    return torch.cat([x.roll(1, dims=-3), x], dim=-2)


def round_counts(chunk_of: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``N_ij`` (Reformer App. A): in how many rounds key ``j`` is in query ``i``'s chunk or the one before.
    ``chunk_of (B, H, R, Np)`` each position's chunk per round; ``q_pos (B, H, R, n, C, 1)``,
    ``k_pos (B, H, R, n, 1, W)`` positions → ``(B, H, R, n, C, W)`` float, at least 1."""
    count = torch.zeros((), device=chunk_of.device)
    for r in range(chunk_of.shape[2]):
        c = chunk_of[:, :, r]  # (B, H, Np)
        ci = c.gather(-1, q_pos.flatten(2)).view(q_pos.shape)
        cj = c.gather(-1, k_pos.flatten(2)).view(k_pos.shape)
        count = count + ((ci - cj == 0) | (ci - cj == 1))
    return count.clamp_min(1)  # 0 only for chunk 0's masked look-back slot


@register_kernel
class LSHAttention(AttentionKernel):
    """Reformer LSH self-attention (module docstring), shared-QK: ``k`` is not read.

    Options (HF ``ReformerConfig`` names in brackets):
        n_buckets: hash buckets per round (``num_buckets``); 1 or even. ``≈ 2N / chunk_size`` is the usual
            choice (HF's automatic value); 1 puts every token in one bucket (chunked attention in order).
        n_hashes: hash rounds (``num_hashes``); more rounds, fewer similar pairs missed, ``n_hashes`` × the cost.
        chunk_size: tokens per chunk (``lsh_attn_chunk_length``); each chunk reads itself and the chunk before
            it (``lsh_num_chunks_before=1``, ``lsh_num_chunks_after=0``).
        seed: seeds the random rotations (``hash_seed``), drawn once: the same hash function in training and
            eval and in every call; every layer built with the same seed hashes alike.

    ``forward(q, k, v, mask)``: ``q, v (B, H, N, Dh)`` float (computed in float32, returned in ``q.dtype``);
    ``k`` is ignored — the keys are the queries scaled to length ``√Dh`` (trax's ``length_normalized``, HF's
    ``_len_norm``) and scores are ``q·k / √Dh`` (so ``|q|·cos``, as in trax and HF), which leaves the layer's
    key projection unused (its weights get no gradient). ``mask`` (True = may attend): padding and causal
    (positions compared in the original order after sorting). A token reads itself only when no other key is
    allowed (score −1e5); a query with no key it may read (e.g. a padded token among padding) gives 0.

    Against HF / trax: a key found in several rounds is counted once (the paper's ``N_ij``; HF counts it in
    each round) and chunk 0 has no chunk before it (HF wraps around to the last one). Not applied: attention
    dropout, ALiBi and relative biases (a registered kernel reads only the mask). Causal attention never reads a
    later token, but which earlier tokens share a chunk depends on where later tokens hash: a sequence's prefix
    alone can be chunked differently than inside the whole sequence.

    Raises:
        ValueError: at construction, for ``n_buckets`` not 1 or even, or ``n_hashes`` / ``chunk_size`` < 1;
            in ``forward``, for a mask rule other than padding and causal (``check``: spans, documents, windows,
            block-sparse, KV cache), or for ``v`` with another length than ``q`` (cross-attention).
    """

    name = "lsh"
    masks = frozenset({"padding", "causal"})

    def __init__(
        self,
        n_heads: int,
        head_dim: int,
        n_buckets: int = 32,
        n_hashes: int = 1,
        chunk_size: int = 64,
        seed: int = 0,
    ):
        super().__init__(n_heads, head_dim)
        if n_buckets < 1 or (n_buckets > 1 and n_buckets % 2):
            raise ValueError(
                f"lsh: n_buckets must be 1 or a positive even number (argmax over [xR; -xR]), got {n_buckets}"
            )
        if n_hashes < 1 or chunk_size < 1:
            raise ValueError(f"lsh: n_hashes and chunk_size must be >= 1, got {n_hashes} and {chunk_size}")
        self.n_buckets, self.n_hashes, self.chunk_size, self.seed = n_buckets, n_hashes, chunk_size, seed
        # a plain attribute, not a buffer: it follows from the seed, so checkpoints and meta-device
        # initialisation (to_empty) leave it alone; moved to the input's device at the first call there
        g = torch.Generator().manual_seed(seed)
        self.rotations = torch.randn(n_hashes, n_heads, head_dim, n_buckets // 2, generator=g, device="cpu")

    def extra_repr(self) -> str:
        return f"n_buckets={self.n_buckets}, n_hashes={self.n_hashes}, chunk_size={self.chunk_size}, seed={self.seed}"

    def flops(self, batch: int, n_queries: int, n_keys: int, causal: bool) -> int:
        """Matmul FLOPs of ``forward`` over ``N = n_queries`` tokens (``AttentionKernel.flops``), causal or
        not (the mask only fills scores): per round, on the ``Np = ⌈N / C⌉ · C`` tokens padded to whole
        chunks of ``C = min(chunk_size, N)``,

        - hashing ``x R`` (``hash_buckets``): ``2 · B · H · Np · Dh · n_buckets/2`` (none for one bucket);
        - scores ``q kᵀ`` and ``weights @ v`` of each chunk against its ``W`` keys (``W = 2C``, itself and
          the chunk before it, when there are several chunks, else ``C``): ``2 · B · H · Np · W · Dh`` each,
          the look-back of chunk 0 computed and masked;

        times ``n_hashes`` rounds (Kitaev et al. 2020 §3 and App. A, as this kernel computes it):
        ``R · B · H · Np · Dh · (n_buckets + 4 W)`` with one bucket counted as 0 hashing columns."""
        R, H, Dh, N = self.n_hashes, self.n_heads, self.head_dim, n_queries
        C = min(self.chunk_size, N)
        n = -(-N // C)
        W = 2 * C if n > 1 else C
        columns = self.n_buckets if self.n_buckets > 1 else 0  # 2 · n_buckets/2
        return R * batch * H * n * C * Dh * (columns + 4 * W)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec) -> Tensor:
        """``q, v (B, H, N, Dh)`` → ``(B, H, N, Dh)`` (class docstring); ``k`` is not read."""
        self.check(mask)
        B, H, N, Dh = q.shape
        if v.shape[2] != N:
            raise ValueError(f"lsh is shared-QK self-attention: {N} queries but {v.shape[2]} values")
        if self.rotations.device != q.device:
            self.rotations = self.rotations.to(q.device)
        R, C = self.n_hashes, min(self.chunk_size, N)
        n = math.ceil(N / C)
        Np, pad = n * C, n * C - N
        valid = torch.ones(B, N, dtype=torch.bool, device=q.device) if mask.valid is None else mask.valid
        keep = torch.cat([valid, valid.new_zeros(B, pad)], dim=1)  # (B, Np): real, unpadded tokens
        # padded tokens may hold anything, even NaN (the layer zeroes k and v only, and q serves as the keys)
        qf, vf = (F.pad(t.float(), (0, 0, 0, pad)).masked_fill(~keep[:, None, :, None], 0.0) for t in (q, v))
        kf = qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + 1e-6)  # (B, H, Np, Dh): length √Dh
        with torch.no_grad():
            buckets = hash_buckets(qf, self.rotations)  # (B, H, R, Np)
            buckets = buckets.masked_fill(~keep[:, None, None, :], self.n_buckets)  # padding sorts last
            order, undo = sort_by_bucket(buckets)  # (B, H, R, Np)

        def chunked(t: Tensor) -> Tensor:  # (B, H, Np, ·) sorted per round → (B, H, R, n, C, ·)
            return take(t.unsqueeze(2).expand(B, H, R, Np, t.shape[-1]), order).view(B, H, R, n, C, -1)

        qs, ks, vs = chunked(qf), chunked(kf), chunked(vf)  # (B, H, R, n, C, Dh)
        q_pos = order.view(B, H, R, n, C, 1)  # original positions, in sorted order
        k_pos, k_ok = q_pos, chunked(keep[:, None, :, None].expand(B, H, Np, 1))
        if n > 1:  # each chunk also reads the one before it; chunk 0 has none
            ks, vs, k_pos, k_ok = (look_back(t) for t in (ks, vs, k_pos, k_ok))
            k_ok[:, :, :, 0, :C] = False
        k_pos, k_ok = k_pos.transpose(-1, -2), k_ok.transpose(-1, -2)  # (B, H, R, n, 1, W)
        allowed = (k_ok & (k_pos <= q_pos)) if mask.causal else k_ok.expand(B, H, R, n, C, k_ok.shape[-1])

        s = (qs @ ks.transpose(-1, -2)) / math.sqrt(Dh)  # (B, H, R, n, C, W)
        s = s.masked_fill(q_pos == k_pos, SELF_SCORE)
        if R > 1:  # count a key found in several rounds once
            s = s - round_counts(undo // C, q_pos, k_pos).log()
        s = s.masked_fill(~allowed, MASKED_SCORE)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)  # (B, H, R, n, C, 1)
        out = torch.exp(s - lse) @ vs  # (B, H, R, n, C, Dh)

        # back to the original order; rounds weighted by their share of the total softmax mass
        out, lse = take(out.view(B, H, R, Np, Dh), undo), take(lse.view(B, H, R, Np, 1), undo)
        readable = take(allowed.any(-1).view(B, H, R, Np, 1), undo).any(2)  # (B, H, Np, 1)
        out = (torch.softmax(lse, dim=2) * out).sum(2)  # (B, H, Np, Dh)
        return out.masked_fill(~readable, 0.0)[:, :, :N].to(q.dtype)
