"""The cross-entropy of a linear layer's logits without holding the logits: a language model's loss over
a large vocabulary, computed a chunk of rows at a time.

An LM head's logits are ``(N, V)`` float32 — GPT-2's 50,257 or Llama 3's 128,256 numbers per token —
and ``F.cross_entropy(F.linear(h, W), t)`` keeps them, their log-softmax and, in the backward pass, the
gradient with respect to them: three ``N × V`` tensors for a loss that is one number (SmolLM2-135M,
8 × 2,048 tokens: 3.2 GB each). ``linear_cross_entropy`` takes ``chunk_rows`` rows at a time: their logits,
log-sum-exp and loss, and — when gradients are needed — the gradient of the loss with respect to those
logits (``softmax − one-hot``, scaled by the reduction), turned at once into the rows' gradient
``∂h = G W`` and the weight's ``∂W += Gᵀ h`` (and ``∂b += Σ G``). At most one ``chunk_rows × V`` block is
alive; the backward pass only scales the gradients by the incoming one. The same loss and gradients as
the unfused computation up to float rounding (sums in another order): ``tests/nn/test_linear_cross_entropy.py``.
With the head tied to the input embedding, the weight's gradient is handed to that lookup, which adds its
rows into it instead of into a fresh ``V × D`` tensor of zeros (``nn.tied_embedding``).

Source: Liger Kernel's fused linear cross-entropy (Hsu et al. 2024, arXiv:2410.10989, §3.3), which
computes the gradients in the forward pass the same way; Wijmans et al. 2024 (arXiv:2411.09009, "Cut
Your Losses") avoid even the chunk with a custom GPU kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .onednn import _product, covered
from .tied_embedding import hand_over, latest_lookup

REDUCTIONS = ("mean", "sum", "none")


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int = 1024,
    onednn: bool = False,
) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ignore_index=…, reduction=…)``
    over rows flattened, without the ``(N, V)`` logits: ``chunk_rows`` rows at a time.

    ``hidden (..., D)`` float, ``weight (V, D)``, ``bias (V,)`` or None, ``targets (...)`` long class ids
    (``ignore_index`` where a row counts for nothing). The logits are taken in float32 (under autocast the
    products run in its dtype, as ``F.linear`` would; float64 inputs stay float64). ``reduction``:
    ``"mean"`` over the counted rows (NaN when none counts, as ``F.cross_entropy``), ``"sum"``, or
    ``"none"`` — ``(...)`` float32 losses, 0 at ignored rows; with gradients needed ``"none"`` runs the
    unfused computation (the rows' weights are not known until the backward pass). ``onednn``: the
    products on oneDNN where ``nn.onednn`` covers them (for a head routed there). The gradients are
    computed with the loss and held until the backward pass (one ``hidden``- and one ``weight``-sized
    tensor): backward through the loss once (a second, with ``retain_graph``, raises ``RuntimeError``).

    Raises ``ValueError`` for an unknown ``reduction``, a ``chunk_rows < 1``, or ``targets`` whose shape is
    not ``hidden``'s without its last dimension."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets {tuple(targets.shape)} must have hidden's shape {tuple(hidden.shape)} without "
            "its last dimension"
        )
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if reduction == "none" and grads:
        return logits_cross_entropy(F.linear(hidden, weight, bias), targets, ignore_index, "none")
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if not grads:
        with torch.no_grad():
            losses = _chunks(h, weight, bias, t, ignore_index, chunk_rows, onednn, scale=None)[0]
        return _reduce(losses, t != ignore_index, reduction).view(
            targets.shape if reduction == "none" else ()
        )
    return _LinearCrossEntropy.apply(
        h, weight, bias, t, ignore_index, reduction == "mean", chunk_rows, onednn
    )


def logits_cross_entropy(
    logits: Tensor, targets: Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """``F.cross_entropy`` of ``logits (..., V)``, taken in float32 (float64 stays), against ``targets
    (...)``; ``"none"`` gives ``(...)``. The unfused computation, for heads ``linear_cross_entropy`` does
    not cover."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, -2)
    losses = F.cross_entropy(logits, targets.flatten(), ignore_index=ignore_index, reduction=reduction)
    return losses.view(targets.shape) if reduction == "none" else losses


def _reduce(losses: Tensor, counted: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return losses
    total = losses.sum()
    return total / counted.sum() if reduction == "mean" else total


def _chunks(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    t: Tensor,
    ignore_index: int,
    chunk_rows: int,
    onednn: bool,
    scale: Tensor | float | None,
    need: tuple[bool, bool, bool] = (False, False, False),
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Per-row losses ``(N,)`` float32 (float64 for float64 rows; 0 at ignored rows) and, where
    ``need``-ed, the gradients of ``scale · Σ losses`` with respect to ``h``, ``weight`` and ``bias``."""
    counted = t != ignore_index
    safe = t.masked_fill(~counted, 0)
    wide = torch.promote_types(h.dtype, torch.float32)  # the logits' dtype: float32, or float64's own
    losses = torch.empty(h.shape[0], dtype=wide, device=h.device)
    grad_h = torch.empty_like(h) if need[0] else None
    grad_w = grad_b = None  # float32 sums over the chunks, from the first chunk's terms
    mm = _product if onednn and covered(h, weight, bias) else _aten
    for s in range(0, h.shape[0], chunk_rows):
        rows, ids, keep = h[s : s + chunk_rows], safe[s : s + chunk_rows], counted[s : s + chunk_rows]
        logits = mm(rows, weight, bias).to(wide)  # (c, V)
        lse = torch.logsumexp(logits, dim=-1)
        target = logits.gather(1, ids[:, None])[:, 0]
        losses[s : s + chunk_rows] = (lse - target).masked_fill_(~keep, 0.0)
        if scale is None:
            continue
        grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
        grad.scatter_add_(1, ids[:, None], torch.full_like(lse, -1.0)[:, None])  # − one-hot
        grad.mul_((keep * scale)[:, None])  # ignored rows contribute nothing
        grad = grad.to(rows.dtype)  # the products' dtype (under autocast, F.linear casts anyway)
        if grad_h is not None:
            grad_h[s : s + chunk_rows] = mm(grad, weight.t(), None)  # (c, V) @ (V, D)
        if need[1]:
            grad_w = _accumulate(grad_w, grad.t(), rows, mm)  # (V, c) @ (c, D)
        if need[2] and bias is not None:
            grad_b = grad.sum(0, dtype=wide) if grad_b is None else grad_b.add_(grad.sum(0))
    return losses, grad_h, grad_w, grad_b


def _accumulate(total: Tensor | None, a: Tensor, b: Tensor, mm) -> Tensor:
    """``total + a @ b`` in float32, in place where it can be (``addmm_``), ``a @ b`` when ``total`` is None."""
    if total is None:
        return mm(a, b.t(), None).to(torch.promote_types(a.dtype, torch.float32))
    if mm is _aten and a.dtype == b.dtype == torch.float32 and not torch.is_autocast_enabled(a.device.type):
        return total.addmm_(a, b)
    return total.add_(mm(a, b.t(), None))


def _aten(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return F.linear(x, w, b)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, t, ignore_index, mean, chunk_rows, onednn):
        counted = t != ignore_index
        n = counted.sum().to(torch.promote_types(h.dtype, torch.float32))  # the logits' dtype
        scale = 1.0 / n if mean else 1.0  # a tensor for the mean: no host sync
        need = ctx.needs_input_grad[:3]
        # with no row counted the mean is NaN, as F.cross_entropy's, and so are not its gradients: zero,
        # as F.cross_entropy's (0 · inf would make every gradient NaN)
        grad_scale = 1.0 / n.clamp_min(1) if mean else 1.0
        losses, *grads = _chunks(h, weight, bias, t, ignore_index, chunk_rows, onednn, grad_scale, need)
        ctx.grads = [g.to(x.dtype) if g is not None else None for g, x in zip(grads, (h, weight, bias))]
        ctx.lookup = latest_lookup(weight) if need[1] else None  # a tied input embedding's (tied_embedding)
        return losses.sum() * scale if mean else losses.sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grads = getattr(ctx, "grads", None)
        if grads is None:
            raise RuntimeError(
                "linear_cross_entropy's gradients were computed with the loss and are used once: "
                "backward through it a second time (retain_graph) is not supported"
            )
        del ctx.grads
        # the loss's own gradient is usually exactly 1: skip a pass over the weight-sized gradient then
        # (read without a device sync only on the CPU)
        if not (grad_loss.device.type == "cpu" and grad_loss.item() == 1.0):
            grads = [g.mul_(grad_loss.to(g.dtype)) if g is not None else None for g in grads]
        if grads[1] is not None and hand_over(ctx.lookup, grads[1]):
            grads[1] = None  # the tied lookup adds its rows into it and returns the sum
        return (*grads, None, None, None, None, None)
