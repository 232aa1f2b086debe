"""AdamW with decay / no-decay parameter groups, and linear warmup followed by cosine decay.

No weight decay on norms, biases (every parameter with fewer than 2 dimensions), position
embeddings and class tokens (timm ``param_groups_weight_decay``; Loshchilov & Hutter 2019,
arXiv:1711.05101). Schedule: Goyal et al. 2017 warmup, Loshchilov & Hutter 2017 cosine (SGDR).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: ``decay`` (matrices) and ``no_decay`` (ndim < 2, and ``model.no_weight_decay()``)."""
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or name in skip else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based).

    Linear warmup from ``1/warmup_steps`` to 1 over ``warmup_steps``, then ``cosine`` / ``linear``
    decay to ``min_ratio`` at ``total_steps``, or ``constant``.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * shape


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """``cfg``: ``OptimConfig``."""
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    min_ratio = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0

    def factor(step: int) -> float:
        return lr_factor(step, total_steps, cfg.warmup_steps, cfg.schedule, min_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
