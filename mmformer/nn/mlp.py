"""Transformer MLP: ``fc1 → activation → dropout → fc2 → dropout`` (timm ``Mlp`` names)."""

from __future__ import annotations

from torch import Tensor, nn


class Mlp(nn.Module):
    """Two-layer feed-forward network applied per token.

    Args:
        d_model: input and output width ``D``.
        hidden_dim: inner width (``mlp_ratio · D``).
        act: ``"gelu"`` (exact erf GELU, as timm's ViT) or ``"relu"``.
        drop: dropout after the activation and after ``fc2``.

    Shapes: ``(..., D) → (..., D)``.
    """

    ACTS = {"gelu": nn.GELU, "relu": nn.ReLU}

    def __init__(
        self, d_model: int, hidden_dim: int, act: str = "gelu", bias: bool = True, drop: float = 0.0
    ):
        super().__init__()
        if act not in self.ACTS:
            raise ValueError(f"unknown MLP activation {act!r}; choose from {sorted(self.ACTS)}")
        self.fc1 = nn.Linear(d_model, hidden_dim, bias=bias)
        self.act = self.ACTS[act]()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, d_model, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))
