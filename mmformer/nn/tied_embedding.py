"""An embedding lookup whose weight gradient joins a tied LM head's instead of starting from zeros.

A language model whose input and output embeddings are one matrix (GPT-2, SmolLM2, Llama 3.2 1B) gets
that matrix's gradient from two places: the LM head (``V × D``, dense) and the lookup of the input ids (a
few rows). PyTorch's embedding backward writes those rows into a fresh ``V × D`` tensor of zeros
(``embedding_dense_backward``) that autograd then adds to the head's: for GPT-2 small 154 MB zeroed —
a fresh allocation, so its page faults too — and 154 MB added, every step, 7–8 % of a 1 × 256-token
training step on a CPU. ``nn.linear_cross_entropy`` computes the head's weight gradient with the loss;
when the lookup that produced its input will run later in the same backward pass, it hands that gradient
over (``hand_over``) and returns none for the weight, and the lookup adds its rows into it (``index_add_``)
and returns the sum. The same gradient up to the order of float additions.

The hand-over happens only when it is certain to be collected: the lookup was of the very same weight
tensor, the backward pass will run it (``torch._C._will_engine_execute_node``) and has not run it yet.
Otherwise both gradients flow to autograd as usual.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# id(weight) → the backward node of that weight's latest lookup (entries vanish with the graph)
_LATEST: weakref.WeakValueDictionary[int, _Lookup] = weakref.WeakValueDictionary()


def embed(module: nn.Module, ids: Tensor) -> Tensor:
    """``module(ids)`` — ``(..., D)`` rows of ``module.weight (V, D)`` for ``ids (...)`` long — with the
    weight's gradient collected as this module describes when ``module`` is a plain ``nn.Embedding`` (no
    ``padding_idx``, ``max_norm``, sparse or frequency-scaled gradients, no hooks) whose weight needs a
    gradient; anything else, or under ``torch.compile``, runs ``module(ids)`` itself. Raises what
    ``F.embedding`` raises (an id out of range: ``IndexError``)."""
    w = getattr(module, "weight", None)
    if (
        type(module) is not nn.Embedding
        or not (torch.is_grad_enabled() and w.requires_grad)
        or module.padding_idx is not None
        or module.max_norm is not None
        or module.sparse
        or module.scale_grad_by_freq
        or module._forward_hooks
        or module._forward_pre_hooks
        or type(w.data) is not torch.Tensor
        or torch.compiler.is_compiling()
    ):
        return module(ids)
    return _Lookup.apply(ids, w)


def latest_lookup(weight: Tensor) -> weakref.ref | None:
    """A weak reference to the backward node of ``weight``'s latest lookup through ``embed`` still part
    of a graph, or None. Taken by a head when its forward runs (the lookup that fed it came before)."""
    node = _LATEST.get(id(weight))
    return weakref.ref(node) if node is not None and node.weight() is weight else None


def hand_over(lookup: weakref.ref | None, grad_weight: Tensor) -> bool:
    """During a backward pass: give ``grad_weight`` (the weight's whole gradient from a head, a dense
    tensor autograd has not seen) to the lookup node, which adds its rows into it and returns it as the
    weight's gradient. True when it took it — the caller then returns None for the weight —, False when
    the lookup is gone, already ran, already holds a hand-over, or is not part of this backward pass."""
    node = lookup() if lookup is not None else None
    if (
        node is None
        or node.ran
        or node.handed is not None
        or grad_weight.shape != node.weight_shape
        or not torch._C._will_engine_execute_node(node)
    ):
        return False
    node.handed = grad_weight
    return True


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weakref.ref(weight)
        ctx.weight_shape = weight.shape
        ctx.ran, ctx.handed = False, None
        _LATEST[id(weight)] = ctx
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        ctx.ran = True
        if not ctx.needs_input_grad[1]:
            return None, None
        total, ctx.handed = ctx.handed, None
        if total is None:  # what F.embedding's own backward computes
            return None, torch.ops.aten.embedding_dense_backward(grad, ids, ctx.weight_shape[0], -1, False)
        rows = grad.reshape(-1, grad.shape[-1]).to(total.dtype)
        return None, total.index_add_(0, ids.reshape(-1), rows)
