"""FLOPs per sample, counted by ``torch.utils.flop_counter`` on the eager attention path.

``FlopCounterMode`` does not count ``scaled_dot_product_attention`` on CPU, so the count switches the
backbone to the eager kernel (plain matmuls) for the measurement and restores it afterwards.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from ..nn.attention import Attention
from .model import MultimodalModel


def count_flops(model: MultimodalModel, inputs: Tensor, tokenizer: str, head: str) -> dict[str, int]:
    """FLOPs for one forward and one forward+backward of ``inputs`` (1 FLOP = 1 multiply or add;
    a multiply-accumulate counts 2). Divide by ``inputs.shape[0]`` for per-sample values.

    Returns ``{"forward": int, "train": int}``; ``train`` counts forward + backward of a scalar loss.
    """
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    kernels = [a.kernel for a in attns]
    for a in attns:
        a.kernel = "eager"
    try:
        with FlopCounterMode(display=False) as fwd:
            with torch.no_grad():
                model(inputs, tokenizer, head)
        with FlopCounterMode(display=False) as train:
            model(inputs, tokenizer, head).float().sum().backward()
        model.zero_grad(set_to_none=True)
    finally:
        for a, k in zip(attns, kernels):
            a.kernel = k
    return {"forward": fwd.get_total_flops(), "train": train.get_total_flops()}
