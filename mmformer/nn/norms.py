"""Normalisation layers by name: LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019,
arXiv:1910.07467), both torch's own."""

from __future__ import annotations

from torch import nn

NORMS = ("layernorm", "rmsnorm")


def build_norm(kind: str, dim: int, eps: float = 1e-6) -> nn.Module:
    """``"layernorm"`` → ``nn.LayerNorm``; ``"rmsnorm"`` → ``nn.RMSNorm`` (Zhang & Sennrich 2019)."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; choose layernorm or rmsnorm")
