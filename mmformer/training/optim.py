"""AdamW with decay / no-decay parameter groups, and linear warmup followed by cosine decay.

No weight decay on norms, biases (every parameter with fewer than 2 dimensions), position
embeddings and class tokens (timm ``param_groups_weight_decay``; Loshchilov & Hutter 2019,
arXiv:1711.05101). Schedule: Goyal et al. 2017 warmup, Loshchilov & Hutter 2017 cosine (SGDR).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def layer_id(name: str, n_layers: int) -> int:
    """Depth of parameter ``name`` for layer-wise LR decay (BEiT's ``get_layer_id_for_vit``):
    tokenizers (embeddings) 0, ``backbone.blocks.i`` i + 1, the final norm and heads ``n_layers + 1``."""
    if name.startswith("tokenizers."):
        return 0
    if name.startswith("backbone.blocks."):
        return int(name.split(".")[2]) + 1
    return n_layers + 1


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float | None = None) -> list[dict]:
    """``decay`` (matrices) and ``no_decay`` (ndim < 2, and ``model.no_weight_decay()``) groups of the
    trainable parameters (frozen ones are left out).

    With ``layer_decay`` (layer-wise LR decay, Clark et al. 2020 ELECTRA §A; BEiT, Bao et al. 2021) each
    group is split by depth and carries ``lr_scale = layer_decay ** (n_layers + 1 - layer_id)``: heads
    train at the full LR, each block below at ``layer_decay`` times the one above, embeddings lowest.
    """
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    n_layers = len(model.backbone.blocks) if hasattr(model, "backbone") else 0
    groups: dict[tuple[str, int], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        kind = "no_decay" if p.ndim < 2 or name in skip else "decay"
        depth = layer_id(name, n_layers) if layer_decay is not None else n_layers + 1
        group = groups.setdefault(
            (kind, depth),
            {
                "params": [],
                "weight_decay": weight_decay if kind == "decay" else 0.0,
                "name": kind if layer_decay is None else f"{kind}/layer_{depth}",
                "lr_scale": 1.0 if layer_decay is None else layer_decay ** (n_layers + 1 - depth),
            },
        )
        group["params"].append(p)
    if layer_decay is None:  # always both groups, in this order, even when one is empty
        for kind in ("decay", "no_decay"):
            groups.setdefault(
                (kind, n_layers + 1),
                {
                    "params": [],
                    "weight_decay": weight_decay if kind == "decay" else 0.0,
                    "name": kind,
                    "lr_scale": 1.0,
                },
            )
        return [groups[("decay", n_layers + 1)], groups[("no_decay", n_layers + 1)]]
    return [groups[k] for k in sorted(groups, key=lambda k: (k[1], k[0]))]


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
    """``cfg``: ``OptimConfig``. Each group's LR is ``cfg.lr · lr_scale`` (the schedule multiplies it).
    Raises ``ValueError`` when no parameter is trainable."""
    groups = param_groups(model, cfg.weight_decay, getattr(cfg, "layer_decay", None))
    if not any(p.requires_grad for g in groups for p in g["params"]):
        raise ValueError("every parameter is frozen: nothing to train")
    for g in groups:
        g["lr"] = cfg.lr * g["lr_scale"]
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        **adamw_kernel(groups, getattr(cfg, "implementation", "fused")),
    )


FUSED_DEVICES = ("cpu", "cuda", "xpu", "mps")  # where torch has a fused AdamW (floating-point tensors)


def adamw_kernel(groups: list[dict], implementation: str = "fused") -> dict:
    """AdamW's keyword arguments for ``implementation`` (``fused`` | ``foreach`` | ``for-loop``). Fused
    falls back to foreach when a trainable tensor is on a device or of a dtype without the fused kernel
    (the update is the same AdamW either way; fused does it in one pass over all tensors)."""
    if implementation == "for-loop":
        return {"foreach": False}
    if implementation == "fused":
        params = [p for g in groups for p in g["params"]]  # frozen ones too: a schedule may unfreeze them
        if all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params):
            return {"fused": True}
    return {"foreach": True}


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """One warmup + decay shape for every group (LambdaLR scales each group's own initial LR)."""
    min_ratio = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0

    def factor(step: int) -> float:
        return lr_factor(step, total_steps, cfg.warmup_steps, cfg.schedule, min_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
