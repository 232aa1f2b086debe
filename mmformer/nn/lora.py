"""Low-rank adapters (LoRA; Hu et al. 2021, arXiv:2106.09685 §4.1), as PEFT's ``lora.Linear``.

``LoRALinear`` wraps a frozen ``nn.Linear`` (kept as ``base``): ``y = base(x) + (α / r) · B(A(dropout(x)))``
with ``A`` Kaiming-uniform and ``B`` zero, so a freshly adapted model computes exactly what the base
model did. ``apply_lora`` wraps the named linear layers of a model and freezes everything else it is
told to; ``merge_lora`` folds the adapters back into plain ``nn.Linear`` layers
(``W + (α / r) · B A``), which compute the same function without the extra matmuls.

Shapes: ``(..., in_features) → (..., out_features)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class LoRALinear(nn.Module):
    """Args: ``base`` (the pretrained ``nn.Linear``, frozen), ``rank`` r ≥ 1, ``alpha`` α, ``dropout``
    on the adapter's input. Raises ``ValueError`` for ``rank < 1``."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base, self.rank, self.scaling = base, rank, alpha / rank
        base.requires_grad_(False)
        w = base.weight
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=w.device, dtype=w.dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=w.device, dtype=w.dtype)
        self.lora_dropout = nn.Dropout(dropout)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the adapter folded into its weight."""
        out = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.base.bias is not None,
            device=self.base.weight.device,
        ).to(self.base.weight.dtype)
        out.weight.copy_(self.base.weight + self.scaling * self.lora_B.weight @ self.lora_A.weight)
        if self.base.bias is not None:
            out.bias.copy_(self.base.bias)
        return out


def apply_lora(
    model: nn.Module,
    targets: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2"),
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    within: str = "",
) -> list[str]:
    """Wrap every ``nn.Linear`` under ``within`` (a sub-module path, ``""`` = whole model) whose attribute
    name is in ``targets`` with a ``LoRALinear``, in place. Returns the wrapped modules' names; raises
    ``ValueError`` when nothing matched (a typo in ``targets``)."""
    root = model.get_submodule(within) if within else model
    wrapped = []
    for name, module in list(root.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and type(child) is nn.Linear:
                setattr(module, child_name, LoRALinear(child, rank, alpha, dropout))
                wrapped.append(f"{within + '.' if within else ''}{name + '.' if name else ''}{child_name}")
    if not wrapped:
        raise ValueError(f"no nn.Linear named one of {list(targets)} under {within or 'the model'!r}")
    return wrapped


def merge_lora(model: nn.Module) -> int:
    """Replace every ``LoRALinear`` in ``model`` by its merged ``nn.Linear`` (in place); returns how many."""
    n = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, child_name, child.merged())
                n += 1
    return n
