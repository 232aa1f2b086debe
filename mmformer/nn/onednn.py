"""Linear layers on oneDNN's matrix products on the CPU, forward and backward, for training.

PyTorch computes a CPU float32 ``F.linear`` and its two backward products with MKL's GEMM. oneDNN's
matmul primitive (``torch.ops.mkldnn._linear_pointwise``, the kernel inductor emits for CPU linears)
computes the same products faster on the plain ``(out, in)`` weights, with no prepacking — so it stays
correct while the optimizer changes the weights every step. Measured on a 1-thread AVX-512 core
(``python bench/linears.py``, ``bench/README.md`` "Linears on oneDNN"): GPT-2 small's tied LM head at
256 rows 431 → 262 ms forward; its blocks' products 7–23 % faster forward + backward; a training step
1.13× (GPT-2 small), 1.18× (SmolLM2-135M), 1.07× (ViT-S) the same model on MKL. Small products lose
(a oneDNN call costs ~0.05 ms more to set up), hence ``use_onednn``'s ``MIN_WEIGHTS``.
On another Xeon core (AVX-512, no AMX) the same products were 0.71–0.85× as fast on oneDNN and the GPT-2
step 0.85×: which library wins depends on the CPU, so ``faster_here()`` measures it (``mmformer train``'s
default, ``trainer.onednn_linears: null``).
Intel's extension for PyTorch (IPEX, ``ipex.optimize(model, optimizer)``) replaced CPU linears the same
way for training; this is that idea without the extra dependency or the packed weight copies.

``onednn_linear(x, weight, bias)`` is ``F.linear`` with both backward products (``∂x = g W``,
``∂W = gᵀ x``) also on oneDNN, and the bias gradient ``Σ g``. It falls back to ``F.linear`` — same values
up to the kernels' rounding — for anything it does not cover: another device or dtype, autocast, a
graph being compiled (inductor picks its own kernels), an active dispatch or function mode
(``FlopCounterMode`` counts the linear's FLOPs as usual), ``torch.func`` transforms, the TorchScript
tracer, operands whose shapes do not match (F.linear's message), tensor subclasses (DTensor shards, fake
tensors), empty or 1-D inputs, or a PyTorch built without oneDNN. Double backward is not supported
(``once_differentiable``: a clear error, never a wrong second derivative).

``use_onednn(module)`` routes every plain ``nn.Linear`` of ``module`` with more than ``MIN_WEIGHTS``
weights (exactly that class, not its subclasses) through it, in place (``onednn_routed``: for a
context): ``state_dict`` keys, parameters and hooks are unchanged; a linear's forward is patched once.
Shapes: ``(..., in_features) → (..., out_features)``.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
import types
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.overrides import _is_torch_function_mode_enabled
from torch.utils._python_dispatch import _get_current_dispatch_mode

_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# below this many weights a oneDNN call's fixed cost (~0.05 ms: the primitive's lookup and memory
# descriptors) outweighs its faster kernel; at 256 × 1024 the two are level (``bench/linears.py``)
MIN_WEIGHTS = 1 << 18


def _product(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``x (..., in) @ w (out, in)ᵀ + b`` on oneDNN; ``w`` may be any strided view (a transpose)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_x = _product(grad, weight.t(), None) if need_x else None  # (..., out) @ (out, in)
        grad_w = _product(grad_rows.t(), x.reshape(-1, x.shape[-1]).t(), None) if need_w else None
        grad_b = grad_rows.sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b


def covered(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether ``onednn_linear`` runs these operands on oneDNN (else it calls ``F.linear``)."""
    return (
        _AVAILABLE
        and not torch.compiler.is_compiling()
        and type(x) is torch.Tensor
        and type(weight.data) is torch.Tensor
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and (bias is None or (type(bias.data) is torch.Tensor and bias.dtype == torch.float32))
        and x.dim() >= 2
        and weight.dim() == 2
        and x.shape[-1] == weight.shape[1]  # else F.linear's own message names the shapes
        and (bias is None or bias.shape == weight.shape[:1])
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
        and _get_current_dispatch_mode() is None  # FlopCounterMode, FakeTensorMode, …: they see F.linear
        and not _is_torch_function_mode_enabled()
        and not torch._C._are_functorch_transforms_active()  # torch.func.grad / vmap / jacrev
        and not torch.jit.is_tracing()
    )


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` — ``x (..., in)``, ``weight (out, in)``, ``bias (out,)`` →
    ``(..., out)`` — with the forward and both backward products on oneDNN where ``covered``."""
    if not covered(x, weight, bias):
        return F.linear(x, weight, bias)
    return _OneDNNLinear.apply(x, weight, bias)


def faster_here(in_features: int = 768, out_features: int = 3072, rows: int = 256, rounds: int = 5) -> bool:
    """Whether ``onednn_linear`` trains a ``rows × in → out`` linear (forward and both backward products)
    at least 5 % faster than ``F.linear`` on this CPU with the current number of threads: the two timed
    alternately, ``rounds`` times each after a warm-up, the median of the per-round ratios. Cached per
    shape and thread count (about 0.3 s the first time at the default GPT-2 MLP shape). False without
    oneDNN. Which library wins depends on the CPU: ``python bench/linears.py`` measured oneDNN 1.15–1.43×
    faster on one AVX-512 Xeon core and 0.71–0.87× on another (``bench/README.md``), hence a measurement
    rather than a fixed default (``trainer.onednn_linears: null``)."""
    return _AVAILABLE and _faster(in_features, out_features, rows, rounds, torch.get_num_threads())


@functools.cache
def _faster(in_features: int, out_features: int, rows: int, rounds: int, threads: int) -> bool:
    del threads  # part of the cache key only
    with torch.inference_mode(False), torch.enable_grad():  # callers may be in either (generate)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(rows, in_features, generator=g, requires_grad=True)
        w = torch.randn(out_features, in_features, generator=g, requires_grad=True)
        b = torch.zeros(out_features, requires_grad=True)
        dy = torch.randn(rows, out_features, generator=g)

        def seconds(f) -> float:
            start = time.perf_counter()
            torch.autograd.backward(f(x, w, b), dy, inputs=[x, w, b])
            return time.perf_counter() - start

        seconds(F.linear), seconds(_OneDNNLinear.apply)  # warm-up: oneDNN creates its primitives
        ratios = [seconds(F.linear) / seconds(_OneDNNLinear.apply) for _ in range(rounds)]
    return statistics.median(ratios) >= 1.05


def forward(self: nn.Linear, x: Tensor) -> Tensor:  # named ``forward``: see ``use_onednn``
    return onednn_linear(x, self.weight, self.bias)


def runs_own_forward(m: nn.Module) -> bool:
    """Whether ``m`` runs its class's forward: no instance ``forward``, or only the bound class method an
    unpickled routed linear carries."""
    f = m.__dict__.get("forward")
    return f is None or (isinstance(f, types.MethodType) and f.__func__ is type(m).forward)


def _plain_linears(module: nn.Module, min_weights: int) -> Iterator[nn.Linear]:
    for m in module.modules():
        if type(m) is nn.Linear and runs_own_forward(m) and m.weight.numel() > min_weights:
            yield m


def use_onednn(module: nn.Module, min_weights: int = MIN_WEIGHTS) -> int:
    """Route the plain ``nn.Linear`` layers of ``module`` with more than ``min_weights`` weights (default
    2¹⁸: from 384 × 1152 up, oneDNN is faster at every row count measured, 16–1,024; at 256 × 1024 level;
    below it slower) through ``onednn_linear``, in place (their instance ``forward``; a linear whose
    forward is already patched, by this or anything else, is left alone). Returns how many were
    routed: 0 when PyTorch has no oneDNN. A pickled model unpickles with PyTorch's own forward (the
    patch is looked up by name) and can be routed again. Not for ``torch.jit.script`` (trace it, or
    ``torch.export``: both see ``aten.linear``)."""
    return len(_route([module], min_weights))


def _route(modules: Iterable[nn.Module], min_weights: int) -> list[nn.Linear]:
    """Patch the instance forward of ``modules``' plain linears above ``min_weights``; returns them."""
    linears = [m for module in modules for m in _plain_linears(module, min_weights)] if _AVAILABLE else []
    for m in linears:
        m.forward = types.MethodType(forward, m)
    return linears


@contextlib.contextmanager
def onednn_routed(modules: Iterable[nn.Module], min_weights: int = MIN_WEIGHTS) -> Iterator[int]:
    """``use_onednn`` for the duration of the context: the linears it routed get their own forward back on
    exit (those routed before stay routed). Yields how many it routed. For an inference pass whose
    products gain (a prompt's prefill: SmolLM2-135M's 20-token prefill 1.31× faster at batch 1, 1.22× at
    batch 4) on a model the caller keeps as it was."""
    routed = _route(modules, min_weights)
    try:
        yield len(routed)
    finally:
        for m in routed:
            if uses_onednn(m):
                del m.forward


def uses_onednn(m: nn.Module) -> bool:
    """Whether ``use_onednn`` routed the linear ``m``."""
    f = m.__dict__.get("forward")
    return isinstance(f, types.MethodType) and f.__func__ is forward
