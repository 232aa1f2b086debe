"""Contrastive losses over paired embeddings, with the other ranks' embeddings gathered **with gradients**.

- ``clip_loss``: symmetric InfoNCE with a learnable temperature (Radford et al. 2021, CLIP §2.3 and its
  Figure 3 pseudocode; OpenCLIP ``ClipLoss`` with ``gather_with_grad=True, local_loss=True``).
- ``siglip_loss``: pairwise sigmoid loss with a learnable temperature and bias (Zhai et al. 2023,
  SigLIP §3 and Algorithm 1; normalised by the global batch size, as the paper's ``-sum / n``).

Distributed: each rank scores its own B rows against the W·B gathered columns and the ranks' losses are
averaged (as DDP averages their gradients). ``torch.distributed.nn.functional.all_gather`` sums the
columns' gradients back to the rank that produced them, so the update equals that of one process on the
whole W·B batch (tested on two CPU processes). Every rank must bring the same batch size.

Shape legend: B local batch, W world size, E embedding width. Embeddings are L2-normalised by the caller.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

MAX_LOGIT_SCALE = math.log(100.0)  # CLIP clips the learned temperature so logits are scaled by at most 100


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def gather_with_grad(x: Tensor) -> tuple[Tensor, int]:
    """``(every rank's x concatenated in rank order (W·B, …), index of this rank's first row)``.

    Gradients reach each rank's own ``x`` from every rank's use of it. Raises ``ValueError`` on every rank
    (together, so none hangs) when the ranks' batch sizes differ — keep ``drop_last: true`` for training.
    """
    world, rank = _world()
    if world == 1:
        return x, 0
    sizes = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([x.shape[0]], device=x.device))
    if len({int(s) for s in sizes}) != 1:
        raise ValueError(
            f"contrastive batches differ across ranks ({[int(s) for s in sizes]}): every rank must "
            "bring the same batch size (set data.drop_last: true)"
        )
    import torch.distributed.nn.functional as dist_fn

    return torch.cat(dist_fn.all_gather(x)), rank * x.shape[0]


def gather_ids(ids: Tensor) -> Tensor:
    """Every rank's ``ids (B,)`` concatenated in rank order (no gradient)."""
    world, _ = _world()
    if world == 1:
        return ids
    parts = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(parts, ids.contiguous())
    return torch.cat(parts)


def _duplicates(ids: Tensor | None, gather: bool, offset: int) -> Tensor | None:
    """``(B, W·B)`` bool: the other pairs (of every rank when ``gather``) that share this row's caption —
    neither positive nor negative — or None when there are none."""
    if ids is None:
        return None
    dup = ids.unsqueeze(1) == (gather_ids(ids) if gather else ids).unsqueeze(0)
    rows = torch.arange(ids.shape[0], device=ids.device)
    dup[rows, rows + offset] = False
    return dup if bool(dup.any()) else None


def _fp32(fn):
    """Run ``fn`` with autocast off on its inputs' device: logits and softmax stay in float32."""

    @functools.wraps(fn)
    def wrapper(a: Tensor, *args, **kwargs):
        with torch.autocast(a.device.type, enabled=False):
            return fn(a, *args, **kwargs)

    return wrapper


@_fp32
def clip_loss(
    a: Tensor, b: Tensor, logit_scale: Tensor, gather: bool = True, ids: Tensor | None = None
) -> Tensor:
    """Symmetric InfoNCE: ``½ (CE(s·a bᵀ, diag) + CE(s·b aᵀ, diag))`` with ``s = exp(logit_scale)``
    (clipped at 100), each row's positive its own pair.

    Args:
        a, b: ``(B, E)`` float, L2-normalised, row i of ``a`` paired with row i of ``b``.
        logit_scale: scalar tensor, the log inverse temperature (CLIP initialises it to ``log(1/0.07)``).
        gather: score against every rank's pairs; False keeps to this rank's (e.g. in evaluation).
        ids: optional ``(B,)`` long caption ids; another pair with the same caption (a second recording
            of one transcript) is left out of the row's softmax instead of counting as a negative.

    Computed in float32 (autocast off). Returns the scalar mean over this rank's rows; the mean over ranks
    is the loss of the global batch.
    """
    all_a, offset = gather_with_grad(a) if gather else (a, 0)
    all_b, _ = gather_with_grad(b) if gather else (b, 0)
    scale = logit_scale.clamp(max=MAX_LOGIT_SCALE).exp()
    labels = torch.arange(a.shape[0], device=a.device) + offset
    logits_ab = scale * a.float() @ all_b.float().T  # (B, W·B)
    logits_ba = scale * b.float() @ all_a.float().T
    dup = _duplicates(ids, gather, offset)
    if dup is not None:
        logits_ab, logits_ba = logits_ab.masked_fill(dup, -torch.inf), logits_ba.masked_fill(dup, -torch.inf)
    return 0.5 * (F.cross_entropy(logits_ab, labels) + F.cross_entropy(logits_ba, labels))


@_fp32
def siglip_loss(
    a: Tensor,
    b: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor,
    gather: bool = True,
    ids: Tensor | None = None,
) -> Tensor:
    """Pairwise sigmoid loss: ``-1/n Σ_ij log σ(z_ij (exp(t') a_i·b_j + bias))`` with ``z_ij = 1`` for
    the pairs and ``-1`` otherwise, ``n`` the global batch size (SigLIP initialises ``t' = log 10`` and
    ``bias = -10``).

    Args: ``a``, ``b``, ``gather``, ``ids`` as ``clip_loss`` (pairs sharing a caption are left out of the
    sum); ``logit_scale``, ``logit_bias`` scalar tensors. Computed in float32.
    Returns this rank's rows' sum divided by B; the mean over ranks is the global batch's loss.
    """
    all_b, offset = gather_with_grad(b) if gather else (b, 0)
    logits = logit_scale.exp() * a.float() @ all_b.float().T + logit_bias  # (B, W·B)
    z = -torch.ones_like(logits)
    rows = torch.arange(a.shape[0], device=a.device)
    z[rows, rows + offset] = 1.0
    terms = -F.logsigmoid(z * logits)
    dup = _duplicates(ids, gather, offset)
    if dup is not None:
        terms = terms.masked_fill(dup, 0.0)
    return terms.sum() / a.shape[0]
