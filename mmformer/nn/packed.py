"""oneDNN-prepacked linear weights for KV-cache decoding of several rows on the CPU.

A decoding step of a batch multiplies a few rows (one new token per sequence) by every weight. For 2–4
rows MKL's products on the plain ``(out, in)`` weights are far from the memory floor; oneDNN's on weights
reordered once into its blocked format (``torch.ops.mkldnn._reorder_linear_weight``, the prepacking
inductor's ``freezing`` pass does) are 1.7–2.9× faster (``bench/README.md``, "A compiled step cached
on disk": SmolLM2-135M's products at 4 rows, 1 thread: qkv 118 → 66 µs, gate+up 378 → 174 µs, the tied
LM head 20.2 → 7.0 ms). At one row they are not (60 against 48 µs for qkv), so one-row steps keep MKL.

``packed_linears(modules, rows)`` is a context manager for a decoding loop: every plain CPU float32
``nn.Linear`` of ``modules`` gets a prepacked copy of its weight (kept in a weak table, not on the module,
so the model stays copyable and picklable; re-packed only when the weight changed) and, inside the
context, a forward that uses it for inputs of one position per row (``(B, 1, in)``, ``B ≥ 2``) without
gradients. Anything else — more positions (a prefill), gradients, a graph being compiled, another dtype,
or a weight modified since it was packed (its version counter, storage or strides differ) — runs
``F.linear`` as before, so the result never uses stale weights. The same values up to the kernels'
rounding (greedy ids equal: ``tests/nn/test_packed.py``). Costs one copy of the packed weights in memory
(540 MB for SmolLM2-135M) and ~0.5 s to pack them, once per weights.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layout import _linears

# module → (the weight's key when packed, the packed weight)
_packed: weakref.WeakKeyDictionary[nn.Linear, tuple[tuple, Tensor]] = weakref.WeakKeyDictionary()


def _key(w: Tensor) -> tuple:
    return (w._version, w.data_ptr(), w.stride(), w.shape)


@contextlib.contextmanager
def packed_linears(modules: Iterable[nn.Module], rows: int) -> Iterator[int]:
    """Inside the context, the float32 CPU linears of ``modules`` multiply ``rows`` one-position rows
    with prepacked weights (packed now unless already packed for these exact weights). Yields how many
    linears use it: 0 when ``rows < 2`` or oneDNN is not available (nothing is changed)."""
    if rows < 2 or not torch.backends.mkldnn.is_available():
        yield 0
        return
    linears = [m for module in modules for m in _linears(module) if m.weight.dtype == torch.float32]
    with torch.no_grad():
        for m in linears:
            entry = _packed.get(m)
            if entry is None or entry[0] != _key(m.weight):
                _packed[m] = (
                    _key(m.weight),
                    torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), rows),
                )
            m.forward = types.MethodType(_packed_forward, m)
    try:
        yield len(linears)
    finally:
        for m in linears:
            m.__dict__.pop("forward", None)


def release(modules: Iterable[nn.Module]) -> None:
    """Drop the packed copies of ``modules``' linears (they are also dropped with the modules)."""
    for module in modules:
        for m in module.modules():
            _packed.pop(m, None)


def _packed_forward(self: nn.Linear, x: Tensor) -> Tensor:
    entry = _packed.get(self)
    w = self.weight
    if (
        torch.compiler.is_compiling()
        or torch.is_grad_enabled()
        or entry is None
        or x.dim() < 2
        or x.shape[-2] != 1
        or x.dtype != w.dtype
        or entry[0] != _key(w)
    ):
        return F.linear(x, w, self.bias)
    rows = x.numel() // x.shape[-1]
    if rows < 2:
        return F.linear(x, w, self.bias)
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), entry[1], self.bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])
