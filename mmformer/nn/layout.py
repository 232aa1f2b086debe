"""Memory layout of linear weights for decoding on the CPU.

``nn.Linear`` stores ``weight (out, in)`` row-major and computes ``x @ weight.T``. On the CPU the
matrix-multiply kernels are several times slower for a transposed right operand when ``x`` has only a
few rows — exactly the shape of KV-cache decoding (one token per sequence): measured with 2 threads,
``(4, 576) @ (576, 960)`` takes 120 µs with the weight row-major and 32 µs with it column-major, and the
two layouts are within ~15 % of each other, either way, for 64–2,048 rows (``bench/README.md``, "decode layout").

``decode_layout(module)`` re-stores every linear weight of ``module`` column-major — the same
``(out, in)`` tensor with the same values and the same ``Parameter`` object, only its strides change
(``weight.t().contiguous().t()``), like the weight prepacking inference engines do once per model.
``train_layout(module)`` restores row-major storage. ``Backbone.for_decoding`` converts its blocks and
``Backbone.forward`` restores them at the first forward that trains or records gradients — whatever
set the training mode (Lightning's loops set ``module.training`` directly, without ``train()``) — so
training, DDP's gradient buckets and the optimizer only ever see the usual layout. Converting costs one
copy of the weights (0.3 s for the 135 M-parameter SmolLM2 on 2 cores), which is why it is kept between
decoding calls rather than undone after each.

Only plain CPU floating-point weights are touched: GPU kernels do not need it, and sharded (DTensor) or
quantized weights are left alone. The same idea as the weight prepacking of PyTorch inductor's
``freezing`` pass, without compiling.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def _linears(module: nn.Module) -> Iterator[nn.Linear]:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            w = m.weight
            if (
                type(w.data) is torch.Tensor
                and w.device.type == "cpu"
                and w.is_floating_point()
                and w.dim() == 2
            ):
                yield m


def decode_layout(module: nn.Module) -> int:
    """Store ``module``'s CPU linear weights column-major (values unchanged). Returns how many were
    converted (0 when they already were: calling it before every decode is cheap)."""
    converted = 0
    with torch.no_grad():
        for m in _linears(module):
            w = m.weight
            if w.is_contiguous() and w.shape[0] > 1 and w.shape[1] > 1:
                w.data = w.data.t().contiguous().t()
                converted += 1
    return converted


def train_layout(module: nn.Module) -> int:
    """Store ``module``'s CPU linear weights row-major (contiguous) again. Returns how many changed."""
    restored = 0
    with torch.no_grad():
        for m in _linears(module):
            if not m.weight.is_contiguous():
                m.weight.data = m.weight.data.contiguous()
                restored += 1
    return restored
