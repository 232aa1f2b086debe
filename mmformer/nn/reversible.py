"""Reversible residual layers: training memory for activations that does not grow with depth.

RevNet (Gomez et al. 2017, "The Reversible Residual Network", arXiv:1707.04585 §3) as the Reformer
applies it to a transformer (Kitaev et al. 2020, arXiv:2001.04451, "Reversible Transformer"). Each
layer carries two streams:

    Y1 = X1 + F(X2)    F: the attention sub-layer,    drop_path1(ls1(attn(norm1(·))))
    Y2 = X2 + G(Y1)    G: the feed-forward sub-layer, drop_path2(ls2(mlp(norm2(·))))

so a layer's inputs follow from its outputs: X2 = Y2 − G(Y1), X1 = Y1 − F(X2). ``ReversibleFunction``
runs the whole stack as one ``torch.autograd.Function`` that keeps only the last layer's outputs: its
backward walks the layers from the top, rebuilds each layer's inputs and recomputes F and G with
gradients on, so one layer's graph exists at a time. The RNG state (CPU, and the device's for CUDA
inputs) is recorded before each sub-layer in forward and restored for its recomputation, so dropout,
attention dropout and drop-path draw the same masks; the caller's RNG stream is left as it was.
References: HF transformers' ``ReversibleFunction`` (``modeling_reformer.py``), revtorch.

Input and output: the stack starts from ``(X1, X2) = (x, x)`` and returns the mean ``(Y1 + Y2) / 2``,
so it maps ``(B, N, D) → (B, N, D)`` like a standard stack and the final norm, heads and towers keep
their widths. (HF's Reformer and trax concatenate ``[Y1; Y2]`` and apply the final LayerNorm on
``2·D``; that would make every head here read ``2·D``.)

``ff_chunks`` (Reformer, "Chunking"): G runs over the sequence in that many pieces, in forward and in
the backward's recomputation (each piece's graph built and released in turn), so the MLP's inner
activation exists for ``N / ff_chunks`` tokens at a time. G acts per token, so the result is the same;
the per-sample drop-path mask is drawn once, before the pieces (dropout inside the MLP draws per piece:
the same distribution, other numbers than one piece).

Parameter names are the pre-norm ``Block``'s (``norm1``, ``attn``, ``ls1``, ``norm2``, ``mlp``,
``ls2``): the same weights load into either (the function differs). The backward returns gradients
for the parameters and for ``AttentionInputs`` tensors that need them (a learned relative-position
table), like any autograd op, so ``torch.autograd.grad``, DDP hooks and gradient scaling see them.
Not supported: double backward; per-block hooks on the training path (``compile_blocks``, FSDP2's
per-block sharding, ``checkpoint_blocks``), since backward calls the sub-layers directly.

Shape legend: B batch, N tokens, D model width.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import fields, is_dataclass, replace

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .attention import Attention, AttentionInputs, KVCache
from .blocks import _branch_tail
from .norms import build_norm


class ReversibleBlock(nn.Module):
    """One reversible layer over a pair of streams: ``(x1, x2) (B, N, D) each → (y1, y2)``.

    Args:
        d_model, attn, mlp, norm, norm_eps, drop_path, layer_scale: as ``Block``.
        ff_chunks: pieces of the sequence the feed-forward runs over, one after another (1: whole).

    Raises ``ValueError`` for ``ff_chunks < 1``.
    """

    def __init__(
        self,
        d_model: int,
        attn: Attention,
        mlp: nn.Module,
        norm: str = "layernorm",
        norm_eps: float = 1e-6,
        drop_path: float = 0.0,
        layer_scale: float | None = None,
        ff_chunks: int = 1,
    ):
        super().__init__()
        if ff_chunks < 1:
            raise ValueError(f"ff_chunks must be >= 1, got {ff_chunks}")
        self.norm1, self.attn = build_norm(norm, d_model, norm_eps), attn
        self.ls1, self.drop_path1 = _branch_tail(d_model, drop_path, layer_scale)
        self.norm2, self.mlp = build_norm(norm, d_model, norm_eps), mlp
        self.ls2, self.drop_path2 = _branch_tail(d_model, drop_path, layer_scale)
        self.ff_chunks = ff_chunks

    def forward(
        self,
        x1: Tensor,
        x2: Tensor,
        inputs: AttentionInputs | None = None,
        *,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> tuple[Tensor, Tensor]:
        y1 = x1 + self.f(x2, inputs, cache=cache, layer=layer)
        y2 = x2 + self.g(y1)
        return y1, y2

    def f(self, x: Tensor, inputs: AttentionInputs | None = None, *, cache=None, layer: int = 0) -> Tensor:
        """The attention sub-layer ``F(x)``."""
        return self.drop_path1(self.ls1(self.attn(self.norm1(x), inputs, cache=cache, layer=layer)))

    def g(self, x: Tensor) -> Tensor:
        """The feed-forward sub-layer ``G(x)``, over ``ff_chunks`` pieces of the sequence."""
        keep = self.keep(x)
        return torch.cat([self.ff(piece) * keep for piece in x.chunk(self.ff_chunks, dim=1)], dim=1)

    def ff(self, x: Tensor) -> Tensor:
        """``ls2(mlp(norm2(x)))`` of some tokens ``x (B, n, D)``: per token, so it may run piecewise."""
        return self.ls2(self.mlp(self.norm2(x)))

    def keep(self, x: Tensor) -> Tensor:
        """G's drop-path factor ``(B, 1, 1)`` (0 or 1 / (1 − p) per sample; ones without drop-path)."""
        return self.drop_path2(x.new_ones(x.shape[0], 1, 1))


class _RngState:
    """The CPU RNG state, and the device's for a CUDA ``device``, when made; ``restored()`` replays it
    inside ``torch.random.fork_rng``, so the caller's stream goes on unchanged afterwards."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextmanager
    def restored(self):
        with torch.random.fork_rng(devices=[self.device] if self.cuda is not None else []):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def _map_grad_tensors(obj, fn):
    """``obj`` with each tensor that requires grad replaced by ``fn(tensor)``, through dataclasses
    (``AttentionInputs``, ``KernelMask``) and tuples (RoPE's ``(cos, sin)``); unchanged parts kept."""
    if isinstance(obj, Tensor):
        return fn(obj) if obj.requires_grad else obj
    if isinstance(obj, tuple):
        return tuple(_map_grad_tensors(o, fn) for o in obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        new = {f.name: _map_grad_tensors(getattr(obj, f.name), fn) for f in fields(obj) if f.init}
        changed = {k: v for k, v in new.items() if v is not getattr(obj, k)}
        return replace(obj, **changed) if changed else obj
    return obj


class ReversibleFunction(torch.autograd.Function):
    """``(x1, x2) → (y1, y2)`` through ``blocks`` (``ReversibleBlock``s), storing only ``(y1, y2)``.

    ``apply(x1, x2, blocks, inputs, n_params, *params, *extra)``: ``params`` every block's parameters,
    ``extra`` the tensors of ``inputs`` that require grad; both only so that backward can return their
    gradients (forward reads them through the modules and ``inputs``).
    """

    @staticmethod
    def forward(ctx, x1, x2, blocks, inputs, n_params, *tensors):
        device = x1.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.blocks, ctx.inputs, ctx.n_params, ctx.rng = blocks, inputs, n_params, []
        index = {id(t): i for i, t in enumerate(tensors)}
        extra = list(range(n_params, len(tensors)))
        ctx.own = [  # per block: the indices of the tensors its sub-layers may give gradients to
            [index[id(p)] for p in b.parameters() if p.requires_grad] + extra for b in blocks
        ]
        for i, block in enumerate(blocks):  # a layer's index picks its own block layout (BigBird)
            f_rng = _RngState(x1.device)
            x1 = x1 + block.f(x2, inputs, layer=i)
            g_rng = _RngState(x1.device)
            x2 = x2 + block.g(x1)
            ctx.rng.append((f_rng, g_rng))
        ctx.save_for_backward(x1, x2)
        return x1, x2

    @staticmethod
    @once_differentiable
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        leaves: list[Tensor] = []  # the extra tensors as leaves of the recomputed graphs, in apply's order

        def leaf_of(t: Tensor) -> Tensor:
            leaves.append(t.detach().requires_grad_())
            return leaves[-1]

        inputs = _map_grad_tensors(ctx.inputs, leaf_of)
        targets = [p for b in ctx.blocks for p in b.parameters()][: ctx.n_params] + leaves
        grads: list[Tensor | None] = [None] * len(targets)

        def accumulate(own: list[int], found: tuple) -> None:
            for i, d in zip(own, found):
                if d is not None:
                    grads[i] = d if grads[i] is None else grads[i] + d

        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            layers = reversed(range(len(ctx.blocks)))
            for i, block, own, (f_rng, g_rng) in zip(
                layers, reversed(ctx.blocks), reversed(ctx.own), reversed(ctx.rng)
            ):
                own_t = [targets[i] for i in own]
                # G, piece by piece: X2 = Y2 − G(Y1); dY1 += (∂G/∂Y1)ᵀ dY2
                x2_pieces, dy1_pieces = [], []
                with g_rng.restored():
                    keep = block.keep(y1)
                    chunks = zip(*(t.chunk(block.ff_chunks, dim=1) for t in (y1, y2, dy2)))
                    for y1_c, y2_c, dy2_c in chunks:
                        with torch.enable_grad():
                            leaf = y1_c.detach().requires_grad_()
                            g = block.ff(leaf) * keep
                        d_leaf, *found = torch.autograd.grad(g, [leaf, *own_t], dy2_c, allow_unused=True)
                        accumulate(own, found)
                        x2_pieces.append(y2_c - g.detach())
                        dy1_pieces.append(d_leaf)
                x2, dy1 = torch.cat(x2_pieces, dim=1), dy1 + torch.cat(dy1_pieces, dim=1)
                # F: X1 = Y1 − F(X2); dX2 = dY2 + (∂F/∂X2)ᵀ dY1; dX1 = dY1
                with f_rng.restored(), torch.enable_grad():
                    leaf = x2.detach().requires_grad_()
                    f = block.f(leaf, inputs, layer=i)
                d_leaf, *found = torch.autograd.grad(f, [leaf, *own_t], dy1, allow_unused=True)
                accumulate(own, found)
                y1, y2, dy2 = y1 - f.detach(), x2, dy2 + d_leaf
        return (dy1, dy2, None, None, None, *grads)


_STORED = [False]


@contextmanager
def stored_activations():
    """Within this block reversible stacks run as plain autograd (every layer's activations kept): the
    same function and gradients, for tools that hook autograd and cannot follow a backward that calls
    ``torch.autograd.grad`` itself (``torch.utils.flop_counter.FlopCounterMode``)."""
    before, _STORED[0] = _STORED[0], True
    try:
        yield
    finally:
        _STORED[0] = before


def reversible_stack(
    blocks: list[ReversibleBlock] | nn.ModuleList,
    x: Tensor,
    inputs: AttentionInputs | None = None,
    cache: KVCache | None = None,
) -> Tensor:
    """``x (B, N, D)`` through reversible ``blocks`` from ``(x, x)`` to the mean of the two streams.

    Recording gradients, it runs as one ``ReversibleFunction`` (activations of one layer at a time);
    otherwise (inference) it is the plain loop, which also takes a KV cache: each layer's attention
    caches the keys and values of its ``X2`` stream.

    Raises ``ValueError`` for a KV cache while gradients are recorded (backward would run the
    attention again and append to the cache twice).
    """
    x1 = x2 = x
    if not torch.is_grad_enabled() or (_STORED[0] and cache is None):
        for i, block in enumerate(blocks):
            x1, x2 = block(x1, x2, inputs, cache=cache, layer=i)
        return (x1 + x2) / 2
    if cache is not None:
        raise ValueError(
            "reversible layers take a KV cache only without gradients (decoding under torch.no_grad / "
            "inference_mode): backward recomputes each attention, which would append to the cache again"
        )
    params = [p for b in blocks for p in b.parameters()]
    extra: list[Tensor] = []
    _map_grad_tensors(inputs, lambda t: extra.append(t) or t)
    y1, y2 = ReversibleFunction.apply(x1, x2, tuple(blocks), inputs, len(params), *params, *extra)
    return (y1 + y2) / 2
