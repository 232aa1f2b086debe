"""The optimizer over decay / no-decay parameter groups, and linear warmup followed by a decay shape.

No weight decay on norms, biases (every parameter with fewer than 2 dimensions), position
embeddings and class tokens (timm ``param_groups_weight_decay``; Loshchilov & Hutter 2019,
arXiv:1711.05101), whichever the optimizer. ``adamw`` is torch's AdamW (fused kernel by default); every
other name is one of timm's optimizers (``timm.optim.create_optimizer_v2``: SGD, Lion (Chen et al. 2023,
arXiv:2302.06675), LAMB (You et al. 2019, arXiv:1904.00962), Adafactor (Shazeer & Stern 2018,
arXiv:1804.04235), …), built on the same groups. Schedule: Goyal et al. 2017 warmup, then Loshchilov &
Hutter 2017 cosine (SGDR), linear, polynomial or step decay (timm's ``PolyLRScheduler`` /
``StepLRScheduler`` with ``warmup_prefix``), as one per-step ``LambdaLR`` that resumes exactly.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn

from ..errors import did_you_mean


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


def lr_factor(
    step: int,
    total_steps: int,
    warmup_steps: int,
    schedule: str,
    min_ratio: float,
    *,
    power: float = 0.5,
    step_size: int | None = None,
    gamma: float = 0.1,
) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based).

    Linear warmup from ``1/warmup_steps`` to 1 over ``warmup_steps``, then, counting from the end of
    warmup: ``cosine`` / ``linear`` / ``poly`` (``(1 - progress) ** power``, timm ``PolyLRScheduler``)
    decay to ``min_ratio`` at ``total_steps``; ``step`` (× ``gamma`` every ``step_size`` steps, timm
    ``StepLRScheduler`` / torch ``StepLR``, never below ``min_ratio``); or ``constant``.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "step":
        return max(min_ratio, gamma ** ((step - warmup_steps) // step_size))
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = {
        "cosine": lambda: 0.5 * (1.0 + math.cos(math.pi * progress)),
        "linear": lambda: 1.0 - progress,
        "poly": lambda: (1.0 - progress) ** power,
    }[schedule]()
    return min_ratio + (1.0 - min_ratio) * shape


SCHEDULES = ("cosine", "linear", "poly", "step", "constant")
ADAMW_BETAS = (0.9, 0.999)  # OptimConfig's default betas: other optimizers keep their own unless set
# timm names mmformer refuses, and why (a prefix covers a family)
UNSUPPORTED = {
    "bnb": "needs bitsandbytes and CUDA, which mmformer does not install",
    "fused": "needs NVIDIA apex and CUDA, which mmformer does not install",
    "adahessian": "is second-order: it needs backward(create_graph=True), which Lightning's loop does not do",
}


def _unsupported(name: str) -> str | None:
    return next((why for prefix, why in UNSUPPORTED.items() if name.startswith(prefix)), None)


def optimizer_names() -> list[str]:
    """Every ``optim.name`` mmformer builds: timm's ``list_optimizers()`` (``adamw`` among them, built
    as torch's fused AdamW) less ``UNSUPPORTED``."""
    import timm.optim  # here, not at the top: import timm pulls in wandb and every model

    return [n for n in timm.optim.list_optimizers() if not _unsupported(n)]


def optimizer_spec(name: str) -> tuple[type, dict]:
    """``(class, {has_eps, has_momentum, has_betas, num_betas})`` of optimizer ``name`` (timm's
    ``OptimInfo``; the class without timm's registry defaults bound).
    Raises ``ValueError`` naming ``optim.name`` with a did-you-mean for a name timm does not list, and
    saying why for one mmformer refuses (``UNSUPPORTED``)."""
    if name == "adamw":
        info = dict(has_eps=True, has_momentum=False, has_betas=True, num_betas=2)
        return torch.optim.AdamW, info
    if why := _unsupported(name):
        raise ValueError(f"optim.name={name!r} {why}; pick another of timm's optimizers")
    names = optimizer_names()
    if name not in names:
        raise ValueError(
            f"optim.name={name!r} is not an optimizer timm lists.{did_you_mean(name.lower(), names)} "
            f"Choose from: {', '.join(names)}"
        )
    import timm.optim  # here, not at the top: import timm pulls in wandb and every model

    info = timm.optim.get_optimizer_info(name)
    spec = {k: getattr(info, k) for k in ("has_eps", "has_momentum", "has_betas", "num_betas")}
    return timm.optim.get_optimizer_class(name, bind_defaults=False), spec


# set through their own optim keys (or the parameter groups), never through opt_args
OWN_KEYS = {
    "params": None,
    "lr": "lr",
    "weight_decay": "weight_decay",
    "betas": "betas",
    "eps": "eps",
    "momentum": "momentum",
    "foreach": "implementation",
    "fused": "implementation",
}


def check_optimizer(cfg) -> None:
    """Checks ``cfg`` (``OptimConfig``) against the optimizer it names: a known ``name``, ``betas`` of the
    optimizer's length, and ``eps`` / ``momentum`` / non-default ``betas`` / ``opt_args`` keys only where
    its class takes them. Raises ``ValueError`` naming the key, with a did-you-mean."""
    cls, spec = optimizer_spec(cfg.name)
    for key, present in (("eps", cfg.eps is not None), ("momentum", cfg.momentum is not None)):
        if present and not spec[f"has_{key}"]:
            raise ValueError(f"optim.{key} does not apply to optim.name={cfg.name!r} (it has no {key})")
    betas = tuple(cfg.betas)
    if betas != ADAMW_BETAS or cfg.name == "adamw":
        if not spec["has_betas"]:
            raise ValueError(f"optim.betas does not apply to optim.name={cfg.name!r} (it has no betas)")
        if len(betas) != spec["num_betas"]:
            raise ValueError(
                f"optim.betas needs {spec['num_betas']} values for {cfg.name}, got {list(betas)}"
            )
    if cfg.implementation != "fused" and cfg.name != "adamw" and "foreach" not in _arguments(cls):
        raise ValueError(
            f"optim.implementation={cfg.implementation!r} does not apply to optim.name={cfg.name!r} "
            "(it has no foreach option); leave it at fused"
        )
    allowed = [a for a in _arguments(cls) if a not in OWN_KEYS]
    for key in cfg.opt_args:
        if key in OWN_KEYS:
            raise ValueError(f"optim.opt_args.{key}: set optim.{OWN_KEYS[key] or 'name'} instead")
        if key not in allowed:
            raise ValueError(
                f"optim.opt_args.{key} is not an argument of {cls.__name__} (optim.name={cfg.name!r})."
                f"{did_you_mean(key, allowed)} Its arguments: {', '.join(allowed)}"
            )


def _arguments(cls: type) -> list[str]:
    return [n for n in inspect.signature(cls.__init__).parameters if n != "self"]


def optimizer_kwargs(cfg) -> dict[str, Any]:
    """The keyword arguments the recipe gives optimizer ``cfg.name`` beyond ``lr`` and ``weight_decay``:
    ``eps`` / ``momentum`` when set, ``betas`` when set (always for AdamW), ``opt_args``, and
    ``foreach`` from ``implementation`` (``foreach`` → True, ``for-loop`` → False) for timm's."""
    kwargs = dict(getattr(cfg, "opt_args", None) or {})
    name = getattr(cfg, "name", "adamw")
    if getattr(cfg, "eps", None) is not None:
        kwargs["eps"] = cfg.eps
    if getattr(cfg, "momentum", None) is not None:
        kwargs["momentum"] = cfg.momentum
    if name == "adamw" or tuple(cfg.betas) != ADAMW_BETAS:
        kwargs["betas"] = tuple(cfg.betas)
    implementation = getattr(cfg, "implementation", "fused")
    if name != "adamw" and implementation != "fused":
        kwargs["foreach"] = implementation == "foreach"
    return kwargs


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """``cfg``: ``OptimConfig``. Each group's LR is ``cfg.lr · lr_scale`` (the schedule multiplies it) and
    its weight decay is the group's (0 for ``no_decay``). ``adamw``: ``torch.optim.AdamW`` with the
    ``implementation`` kernel; any other name: ``timm.optim.create_optimizer_v2`` on the same groups.
    Raises ``ValueError`` when no parameter is trainable, or for a name / key ``check_optimizer`` refuses."""
    groups = param_groups(model, cfg.weight_decay, getattr(cfg, "layer_decay", None))
    if not any(p.requires_grad for g in groups for p in g["params"]):
        raise ValueError("every parameter is frozen: nothing to train")
    for g in groups:
        g["lr"] = cfg.lr * g["lr_scale"]
    name, kwargs = getattr(cfg, "name", "adamw"), optimizer_kwargs(cfg)
    if name == "adamw":
        kernel = adamw_kernel(groups, getattr(cfg, "implementation", "fused"))
        return torch.optim.AdamW(groups, lr=cfg.lr, **{**kwargs, **kernel})
    optimizer_spec(name)  # a clear error for a name timm does not list
    import timm.optim  # here, not at the top: import timm pulls in wandb and every model

    # a list of groups passes through as it is: timm's own grouping (and layer decay) is not applied
    return timm.optim.create_optimizer_v2(
        groups, opt=name, lr=cfg.lr, weight_decay=cfg.weight_decay, **kwargs
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
    """One warmup + decay shape for every group (LambdaLR scales each group's own initial LR); a pure
    function of the step, so a resumed run continues the schedule exactly."""
    min_ratio = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
    shape = {k: getattr(cfg, k) for k in ("power", "step_size", "gamma") if hasattr(cfg, k)}

    def factor(step: int) -> float:
        return lr_factor(step, total_steps, cfg.warmup_steps, cfg.schedule, min_ratio, **shape)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
