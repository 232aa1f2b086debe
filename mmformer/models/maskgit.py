"""MaskGIT / Muse: the masking schedule, the training mask and iterative parallel decoding over a grid of
VQ code ids (Chang et al. 2022, "MaskGIT: Masked Generative Image Transformer", arXiv:2202.04200, §3.1
training, §3.2 iterative decoding, §3.3 mask schedules; Chang et al. 2023, "Muse", arXiv:2301.00704, §2.4
classifier-free guidance on logits). The reference implementation is google-research/maskgit
``maskgit/libml/{mask_schedule,parallel_decode}.py``; names follow it (``mask_len``, ``choice_temperature``).

Pure PyTorch: the network is a ``logits_fn(ids) -> logits`` the caller supplies (the task's
``mmformer.tasks.maskgit``), so the decoding logic is tested with any function.

Shape legend: B batch, N code positions (h·w, row-major), K codebook size (``mask_id`` = K, outside it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..progress import progress

__all__ = ["mask_ratio", "training_mask", "guided_logits", "decode", "decode_schedule"]


def mask_ratio(r: Tensor | float) -> Tensor:
    """The cosine mask schedule γ(r) = cos(π r / 2) (MaskGIT §3.3, the schedule it found best): the
    fraction of the N tokens that are masked at progress ``r`` ∈ [0, 1] (γ(0) = 1: all masked; γ(1) = 0).
    Float tensor of ``r``'s shape."""
    r = torch.as_tensor(r, dtype=torch.float32)
    return torch.cos(math.pi / 2 * r)


def training_mask(batch: int, n: int, *, generator=None, device=None) -> Tensor:
    """MaskGIT's training mask (§3.1): per row, r ~ U(0, 1), ``⌈γ(r) · N⌉`` positions (at least 1)
    chosen uniformly without replacement. ``(B, N)`` bool, True = masked (to be predicted)."""
    r = torch.rand(batch, generator=generator, device=device)
    count = torch.ceil(mask_ratio(r).to(r.device) * n).clamp(1, n).long()  # (B,)
    scores = torch.rand(batch, n, generator=generator, device=device)
    rank = scores.argsort(dim=1).argsort(dim=1)  # (B, N): each position's rank in a random order
    return rank < count[:, None]


def guided_logits(cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
    """Classifier-free guidance on logits (Ho & Salimans 2022; Muse §2.4):
    ``uncond + scale · (cond − uncond)``, computed as ``cond + (scale − 1) · (cond − uncond)`` so that
    ``scale = 1`` returns the conditional logits exactly (0 gives the unconditional ones, up to rounding)."""
    return cond + (scale - 1.0) * (cond - uncond)


def decode_schedule(n: int, steps: int) -> list[int]:
    """How many tokens stay masked after each of ``steps`` decoding steps when every step decodes as the
    reference does: ``⌊N · γ((t + 1) / T)⌋`` clamped to ``[1, still masked − 1]`` (so each step decodes at
    least one token and one stays for the next), 0 after the last. Raises ``ValueError`` unless
    ``1 <= steps <= n``."""
    if not 1 <= steps <= n:
        raise ValueError(
            f"steps={steps} must be in [1, {n}] (one token at least per step over {n} positions)"
        )
    left, out = n, []
    for t in range(steps):
        if t == steps - 1:
            left = 0
        else:
            left = max(1, min(left - 1, int(math.floor(n * float(mask_ratio((t + 1) / steps))))))
        out.append(left)
    return out


def _gumbel(shape, generator, device) -> Tensor:
    """Standard Gumbel noise on ``device``, drawn on the generator's own device (a CPU generator may
    drive a GPU sampler)."""
    u = torch.rand(shape, generator=generator, device=generator.device if generator is not None else device)
    return -torch.log((-torch.log(u.clamp_min(1e-20))).clamp_min(1e-20)).to(device)


@torch.no_grad()
def decode(
    logits_fn: Callable[[Tensor], Tensor],
    batch: int,
    n: int,
    mask_id: int,
    *,
    steps: int = 8,
    temperature: float = 1.0,
    choice_temperature: float = 4.5,
    generator: torch.Generator | None = None,
    device=None,
    callback: Callable[[int, Tensor], None] | None = None,
    bar: bool = False,
) -> Tensor:
    """Iterative parallel decoding (MaskGIT §3.2, reference ``parallel_decode.decode``): start from all
    ``mask_id``; at step t of T, predict every position (``logits_fn(ids (B, N) long) → (B, N, K)`` float),
    sample a token at each masked position (categorical at ``temperature``; 0 = argmax), score each sample
    by its log-probability plus Gumbel noise of scale ``choice_temperature · (1 − (t + 1)/T)`` (the
    reference's annealed "temperature" of the choice: random early, greedy at the end), keep the most
    confident and re-mask the ``decode_schedule(N, T)[t]`` least confident — only among the positions that
    were still masked: a decoded token is final (its confidence is +∞).

    ``callback(t, ids)`` sees the ids after each step; ``bar``: a progress bar over the steps
    (``mmformer.progress``). Returns ``(B, N)`` long code ids, none ``mask_id``.
    Raises ``ValueError`` for ``steps`` outside ``[1, N]`` or a negative temperature.
    """
    if temperature < 0 or choice_temperature < 0:
        raise ValueError(f"temperatures must be >= 0, got {temperature}, {choice_temperature}")
    schedule = decode_schedule(n, steps)
    ids = torch.full((batch, n), mask_id, dtype=torch.long, device=device)
    steps_iter = enumerate(schedule)
    for t, mask_len in progress(steps_iter, "sampling", total=steps, unit="step") if bar else steps_iter:
        unknown = ids == mask_id  # (B, N)
        logits = logits_fn(ids).float()  # (B, N, K)
        logp = torch.log_softmax(logits, dim=-1)
        if temperature == 0:
            sampled = logits.argmax(-1)
        else:
            g = _gumbel(logits.shape, generator, logits.device)  # Gumbel-max = categorical sampling
            sampled = (logits / temperature + g).argmax(-1)
        sampled = torch.where(unknown, sampled, ids)
        confidence = logp.gather(-1, sampled[..., None]).squeeze(-1)  # (B, N) log p of the sample
        anneal = choice_temperature * (1.0 - (t + 1) / steps)
        if anneal > 0:
            confidence = confidence + anneal * _gumbel(confidence.shape, generator, logits.device)
        confidence = confidence.nan_to_num(nan=-math.inf)  # a NaN would sort after the decoded ones
        confidence = confidence.masked_fill(~unknown, math.inf)  # decoded tokens are never re-masked
        if mask_len > 0:
            # the mask_len least confident positions stay masked (ties broken by position: stable sort)
            order = confidence.argsort(dim=1, stable=True)  # ascending
            remask = torch.zeros_like(unknown)
            remask.scatter_(1, order[:, :mask_len], True)
            ids = torch.where(remask, torch.full_like(sampled, mask_id), sampled)
        else:
            ids = sampled
        if callback is not None:
            callback(t, ids)
    return ids
