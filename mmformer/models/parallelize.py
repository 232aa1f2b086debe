"""Execution transforms applied to a built model from outside it (DESIGN.md: the model never hard-codes
them): activation checkpointing per block, ``torch.compile`` per block, and FSDP2 sharding per block.

Applied in this order, the one torchtitan uses (checkpoint inside compile inside shard), each at most
once per module. All three keep ``state_dict`` keys unchanged — a checkpoint written with them loads
into a plain model and back — because they patch or compile modules in place instead of wrapping them
(no ``_orig_mod.`` / ``_checkpoint_wrapped_module.`` prefixes).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .backbone import Backbone


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """Every transformer block of every ``Backbone`` in ``model`` (the shared one and the towers)."""
    return [block for m in model.modules() if isinstance(m, Backbone) for block in m.blocks]


def checkpoint_blocks(model: nn.Module) -> int:
    """Activation checkpointing per block: a block's activations are freed after its forward and
    recomputed in backward (``torch.utils.checkpoint``, non-reentrant, so it composes with
    ``torch.compile`` and FSDP2). Skipped when no gradient is being recorded or a KV cache is
    passed (inference). Random ops replay identically (the RNG state is stashed). Returns the
    number of blocks patched."""
    n = 0
    for block in blocks_of(model):
        if getattr(block, "_mmformer_checkpointed", False):
            continue
        forward = block.forward

        @functools.wraps(forward)
        def checkpointed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled() or kwargs.get("cache") is not None:
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed
        block._mmformer_checkpointed = True
        n += 1
    return n


def compile_blocks(model: nn.Module, **compile_kwargs) -> int:
    """``torch.compile`` every block in place (``nn.Module.compile``: keys stay clean). Blocks are
    compiled one by one, as torchtitan does: all blocks share one compiled graph (same code, same
    shapes), compile time does not grow with depth, and tokenizers / heads with data-dependent shapes
    stay eager. A head that reads only some rows (``ClassifierHead(pool="cls")``) makes the last block a
    second graph (``Backbone.forward(rows=…)``: one more compile, not one per layer). Returns the number
    of blocks compiled."""
    n = 0
    for block in blocks_of(model):
        if getattr(block, "_mmformer_compiled", False):
            continue
        block.compile(**compile_kwargs)
        block._mmformer_compiled = True
        n += 1
    return n


def shard_model(model: nn.Module, mesh, mp_policy=None, root: nn.Module | None = None) -> None:
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) over the 1-D device ``mesh``: each block is its
    own unit (its parameters are gathered just before its forward/backward and freed after), then
    ``root`` (default ``model``; a module holding ``model`` and more parameters) is one root unit for
    everything else (tokenizers, heads, norms). ``mp_policy``: an optional ``MixedPrecisionPolicy``.
    Raises ``ValueError`` when the model has no blocks."""
    from torch.distributed.fsdp import fully_shard

    blocks = blocks_of(model)
    if not blocks:
        raise ValueError("FSDP2 shards per transformer block; this model has none")
    kwargs = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(root if root is not None else model, **kwargs)
