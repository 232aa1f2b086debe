"""Packed linear weights for KV-cache decoding on the CPU: oneDNN-prepacked for several rows, column-major
for one.

A decoding step of a batch multiplies a few rows (one new token per sequence) by every weight. For 2–4
rows MKL's products on the plain ``(out, in)`` weights are far from the memory floor; oneDNN's on weights
reordered once into its blocked format (``torch.ops.mkldnn._reorder_linear_weight``, the prepacking
inductor's ``freezing`` pass does) are 1.7–2.9× faster (``bench/README.md``, "A compiled step cached
on disk": SmolLM2-135M's products at 4 rows, 1 thread: qkv 118 → 66 µs, gate+up 378 → 174 µs, the tied
LM head 20.2 → 7.0 ms). At one row they are not (60 against 48 µs for qkv).

At one row the products are memory-bound, and what helps is the layout: a weight stored column-major
(``nn.layout``'s decode layout of the blocks) is read faster than a row-major one — the tied LM head
of SmolLM2 (49152 × 576, 113 MB) 11.3 → 6.5 ms per one-row product, 1 thread — so one-row steps get a
column-major copy of the weights still row-major (the head, which shares the embedding's storage).

``packed_linears(modules, rows)`` is a context manager for a decoding loop: every plain CPU float32
``nn.Linear`` of ``modules`` gets a packed copy of its weight — oneDNN's for ``rows ≥ 2``, column-major
for one row where the weight is row-major — kept in a weak table, not on the module, so the model
stays copyable and picklable; re-packed only when the weight changed. Inside the context its forward
uses the copy, without gradients, for inputs of at most ``rows`` rows: one position per sequence
(``(B, 1, in)``, ``rows = B``) or, with prompt-lookup decoding (``models.prompt_lookup``), the last
token and its draft (``(B, 1 + K, in)``, ``rows = B · (1 + K_max)``: one oneDNN-packed copy serves any
number of rows: a 4–11-row product on it costs 35–45 % less than MKL's on the plain weights, a one-row
product ~25 % more than on a column-major weight, so one row keeps reading a weight that is column-major
(the blocks' decode layout) and, with ``one_row=True``, a column-major copy of a row-major one (the tied
head); ``bench/README.md``). Anything else —
more rows (a prefill), gradients, another dtype, or a weight modified since it was packed (its version
counter, storage or strides differ) — runs ``F.linear`` as before, so the result never uses stale
weights. Traced into a compiled graph (``models.compiled_decoding``'s cached blocks), the
product is one opaque operator, ``mmformer::packed_linear``, that makes the same choice when the graph
runs: the graph holds the weights (as inputs, so inductor's on-disk cache keeps it), and the packed
copies of the open contexts are found by the weight's key. The same values up to the kernels'
rounding (greedy ids equal: ``tests/nn/test_packed.py``). Costs one copy of the packed weights in memory
(540 MB for SmolLM2-135M; the head's 113 MB at one row) and ~0.5 s to pack them, once per weights and
row count.
"""

from __future__ import annotations

import collections
import contextlib
import types
import weakref
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layout import _linears
from .onednn import _product

# module → (the weight's key when packed, "onednn" or "column-major", the packed weight, the most rows
# an input may have to use it: the last context's ``rows``, a choice of speed only; a column-major copy of
# a row-major weight for one-row inputs beside the oneDNN one, or None)
_packed: weakref.WeakKeyDictionary[nn.Linear, tuple[tuple, str, Tensor, int, Tensor | None]] = (
    weakref.WeakKeyDictionary()
)
# module → its own instance forward inside a ``packed_linears`` context (``nn.onednn``'s), for the
# inputs the packed weights do not cover and to restore on exit
_unpacked: weakref.WeakKeyDictionary[nn.Linear, types.MethodType] = weakref.WeakKeyDictionary()
# the oneDNN-packed weights of the open contexts by their weight's key, for ``packed_linear`` to find at
# run time inside a compiled graph (which holds the weights, not the modules): key → (the packed weight,
# the weight itself — kept alive so that no other tensor can take its storage's address while the entry
# exists); ``_opened`` counts the registrations of each key by the open contexts
_active: dict[tuple, tuple[Tensor, Tensor]] = {}
_opened: collections.Counter[tuple] = collections.Counter()


def _key(w: Tensor) -> tuple:
    return (w._version, w.data_ptr(), w.stride(), w.shape)


def _pack(w: Tensor, rows: int) -> tuple[str, Tensor] | None:
    """The packed form of ``w (out, in)`` for ``rows`` one-position rows, or None when it has none."""
    if rows >= 2:
        return "onednn", torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)
    if w.is_contiguous() and min(w.shape) > 1:  # a row-major weight at one row: a column-major copy
        return "column-major", w.detach().t().contiguous().t()
    return None  # already column-major (``nn.layout``'s decode layout of the blocks)


@contextlib.contextmanager
def packed_linears(modules: Iterable[nn.Module], rows: int, one_row: bool = False) -> Iterator[int]:
    """Inside the context, the float32 CPU linears of ``modules`` multiply inputs of at most ``rows``
    rows (one position per sequence, or a token and its draft) with packed weights (packed now unless
    already packed for these exact weights and kind). ``one_row``: one-row inputs occur too (prompt
    lookup's undrafted steps of one sequence), so a row-major weight also gets a column-major copy for
    them. Yields how many linears use it: 0 when oneDNN is not available or ``rows < 1`` (nothing is
    changed)."""
    if rows < 1 or not torch.backends.mkldnn.is_available():
        yield 0
        return
    kind = "onednn" if rows >= 2 else "column-major"
    linears, registered = [], []  # what this context changed and registered, undone exactly on exit
    try:
        with torch.no_grad():
            for module in modules:
                for m in _linears(module):
                    if m.weight.dtype != torch.float32:
                        continue
                    entry = _packed.get(m)
                    if entry is None or entry[0] != _key(m.weight) or entry[1] != kind:
                        form = _pack(m.weight, rows)
                        if form is None:
                            _packed.pop(m, None)
                            continue
                        entry = (_key(m.weight), *form, rows, None)
                    single = entry[4]
                    if single is None and one_row and kind == "onednn":  # a row-major weight's one-row copy
                        one = _pack(m.weight, 1)
                        single = one[1] if one is not None else None
                    _packed[m] = entry = (*entry[:3], rows, single)
                    own = m.__dict__.get("forward")
                    outermost = own is None or getattr(own, "__func__", None) is not _packed_forward
                    if own is not None and outermost:
                        _unpacked[m] = own
                    m.forward = types.MethodType(_packed_forward, m)
                    linears.append((m, own, outermost))
                    if entry[1] == "onednn":
                        _active[entry[0]] = (entry[2], m.weight)
                        _opened[entry[0]] += 1
                        registered.append(entry[0])
        yield len(linears)
    finally:
        for key in registered:
            _opened[key] -= 1
            if not _opened[key]:
                del _opened[key], _active[key]
        # each back to what it was on entry, the last change first (a module met twice, a nested context)
        for m, own, outermost in reversed(linears):
            if outermost:
                _unpacked.pop(m, None)
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own


def release(modules: Iterable[nn.Module]) -> None:
    """Drop the packed copies of ``modules``' linears (they are also dropped with the modules)."""
    for module in modules:
        for m in module.modules():
            _packed.pop(m, None)


@torch.library.custom_op(
    "mmformer::packed_linear", mutates_args=(), schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor"
)
def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x (rows, in), weight (out, in), bias)`` on the oneDNN-packed copy of ``weight`` that an
    open ``packed_linears`` context holds for exactly this weight (its version counter, storage and
    strides), else ``F.linear`` itself: one opaque operator in a compiled graph, so the graph (its
    weights graph inputs, cacheable on disk) multiplies on packed weights found at run time."""
    entry = _active.get(_key(weight))
    if entry is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return _product(x, entry[0], bias)


@packed_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _packed_forward(self: nn.Linear, x: Tensor) -> Tensor:
    w = self.weight
    if torch.compiler.is_compiling():  # traced into a compiled decoding step: the packed weight at run time
        if not torch.is_grad_enabled() and x.dim() >= 2 and x.shape[-2] == 1:
            y = packed_linear(x.reshape(-1, x.shape[-1]), w, self.bias)
            return y.view(*x.shape[:-1], y.shape[-1])
        return F.linear(x, w, self.bias)
    entry = _packed.get(self)
    if torch.is_grad_enabled() or entry is None or x.dtype != w.dtype or entry[0] != _key(w):
        return _unpacked_forward(self, x)
    _, kind, packed, most, single = entry
    rows = x.numel() // x.shape[-1]
    if rows == 1:  # one row reads a column-major weight faster than a oneDNN-packed one
        if kind == "column-major" or single is not None:
            return F.linear(x, packed if kind == "column-major" else single, self.bias)
        if w.t().is_contiguous():
            return _unpacked_forward(self, x)
    if kind == "onednn" and 1 <= rows <= most:
        y = _product(x.reshape(rows, x.shape[-1]), packed, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])
    return _unpacked_forward(self, x)


def _unpacked_forward(self: nn.Linear, x: Tensor) -> Tensor:
    own = _unpacked.get(self)
    return own(x) if own is not None else F.linear(x, self.weight, self.bias)
