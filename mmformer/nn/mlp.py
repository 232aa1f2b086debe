"""Feed-forward networks applied per token (timm ``Mlp`` names ``fc1``, ``fc2``).

* ``Mlp`` — ``fc1 → GELU / ReLU → dropout → fc2 → dropout`` (ViT, GPT-2, BERT).
* ``SwiGLU`` — ``fc2(silu(gate) · up)`` with ``fc1`` producing ``[gate; up]`` in one fused matmul
  (Shazeer 2020, arXiv:2002.05202; Llama's ``gate_proj`` / ``up_proj`` stacked, ``down_proj`` = fc2).

Shapes: ``(..., D) → (..., D)``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "swiglu")


class Mlp(nn.Module):
    """Args:
    d_model: input and output width ``D``.
    hidden_dim: inner width (``mlp_ratio · D``).
    act: ``"gelu"`` (exact erf, timm's ViT / BERT), ``"gelu_tanh"`` (GPT-2) or ``"relu"``.
    bias: biases on both projections.
    drop: dropout after the activation and after ``fc2``.
    """

    ACTS = {
        "gelu": lambda: nn.GELU(),
        "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
        "relu": lambda: nn.ReLU(),
    }

    def __init__(
        self, d_model: int, hidden_dim: int, act: str = "gelu", bias: bool = True, drop: float = 0.0
    ):
        super().__init__()
        if act not in self.ACTS:
            raise ValueError(f"unknown MLP activation {act!r}; choose from {sorted(self.ACTS)} (or swiglu)")
        self.fc1 = nn.Linear(d_model, hidden_dim, bias=bias)
        self.act = self.ACTS[act]()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, d_model, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class SwiGLU(nn.Module):
    """Gated MLP: ``fc2(silu(x W_gate) ⊙ x W_up)``; ``fc1.weight`` is ``[W_gate; W_up]`` ``(2·hidden, D)``."""

    def __init__(self, d_model: int, hidden_dim: int, bias: bool = False, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_model, 2 * hidden_dim, bias=bias)
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, d_model, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.drop2(self.fc2(self.drop1(F.silu(gate) * up)))


def build_mlp(
    d_model: int, hidden_dim: int, act: str = "gelu", bias: bool = True, drop: float = 0.0
) -> nn.Module:
    """``Mlp`` for gelu / gelu_tanh / relu, ``SwiGLU`` for swiglu."""
    if act == "swiglu":
        return SwiGLU(d_model, hidden_dim, bias=bias, drop=drop)
    return Mlp(d_model, hidden_dim, act=act, bias=bias, drop=drop)
