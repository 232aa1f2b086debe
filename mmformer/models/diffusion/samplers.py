"""Samplers for :class:`~.schedules.GaussianDiffusion`: DDPM ancestral sampling, DDIM, and
classifier-free guidance wrapped around the network.

A ``ModelFn`` maps ``(x_t (B, C, *), t LongTensor (B,))`` to the network output ``(B, C, *)`` or, with
learned variance, ``(B, 2C, *)``. Samples come back in the dtype of ``x_T`` (float32 when drawn here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...progress import progress
from .schedules import GaussianDiffusion

ModelFn = Callable[[Tensor, Tensor], Tensor]


def guided(
    model_fn_with_cond: Callable[[Tensor, Tensor, Tensor], Tensor],
    cond: Tensor,
    null_cond: Tensor,
    cfg_scale: float,
) -> ModelFn:
    """Classifier-free guidance (Ho & Salimans 2022, arXiv:2207.12598): ``uncond + s · (cond - uncond)``.

    ``model_fn_with_cond(x_t, t, cond)`` is called once per step on the batch ``[x_t; x_t]`` with
    conditioning ``[cond; null_cond]`` (``cond`` is ``(B,)`` long class ids or a ``(B, ...)`` tensor,
    ``null_cond`` the same shape). Guidance covers every channel of the mean (ε or v) prediction. When
    the output has twice x_t's channels (learned variance), the last half is the conditional output's
    variance, unguided. This differs from facebookresearch/DiT ``forward_with_cfg``, which guides only
    the first 3 channels. With ``cfg_scale == 1`` the returned function is the plain conditional call
    (no unconditional pass), so it equals it exactly.

    The returned function raises ValueError when the output's channel count is neither C nor 2C.
    """
    if cfg_scale == 1:
        return lambda x_t, t: model_fn_with_cond(x_t, t, cond)

    def model_fn(x_t: Tensor, t: Tensor) -> Tensor:
        out = model_fn_with_cond(torch.cat([x_t, x_t]), torch.cat([t, t]), torch.cat([cond, null_cond]))
        out_cond, out_null = out.chunk(2, dim=0)
        channels = x_t.shape[1]
        if out.shape[1] not in (channels, 2 * channels):
            raise ValueError(f"expected {channels} or {2 * channels} output channels, got {out.shape[1]}")
        mean = out_null[:, :channels] + cfg_scale * (out_cond[:, :channels] - out_null[:, :channels])
        return torch.cat([mean, out_cond[:, channels:]], dim=1)

    return model_fn


def _start(
    shape: Sequence[int], generator: torch.Generator | None, device, x_T: Tensor | None
) -> tuple[Tensor, torch.device]:
    if x_T is not None:
        return x_T, x_T.device
    device = (
        torch.device(device)
        if device is not None
        else (generator.device if generator is not None else torch.device("cpu"))
    )
    return torch.randn(tuple(shape), generator=generator, device=device), device


def _steps(ts: Sequence[int], bar: bool):
    """``ts``, with a progress bar (``mmformer.progress``: a terminal's only) when ``bar``."""
    return progress(ts, "sampling", unit="step") if bar else ts


@torch.no_grad()
def ddpm_sample(
    diffusion: GaussianDiffusion,
    model_fn: ModelFn,
    shape: Sequence[int],
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    x_T: Tensor | None = None,
    clip_x0: bool = True,
) -> Tensor:
    """Ancestral sampling through all T steps (DDPM Algorithm 2, guided-diffusion ``p_sample_loop``):
    ``x_{t-1} = mean + exp(log_variance / 2) · z`` from :meth:`GaussianDiffusion.p_mean_variance`,
    no noise at t = 0; the variance is learned or β̃_t ("fixedsmall").

    ``shape`` is ``(B, C, *)``; ``x_T`` (that shape) replaces the initial draw; noise comes from
    ``generator`` on ``device`` (default: ``x_T``'s, else the generator's, else CPU).
    """
    x, device = _start(shape, generator, device, x_T)
    batch = x.shape[0]
    for i in _steps(range(diffusion.num_timesteps - 1, -1, -1), progress):
        t = torch.full((batch,), i, dtype=torch.long, device=device)
        out = diffusion.p_mean_variance(model_fn(x, t), x, t, clip_x0=clip_x0)
        x = out["mean"]
        if i > 0:
            noise = torch.randn(x.shape, generator=generator, device=device, dtype=x.dtype)
            x = x + torch.exp(0.5 * out["log_variance"]) * noise
    return x


@torch.no_grad()
def ddim_sample(
    diffusion: GaussianDiffusion,
    model_fn: ModelFn,
    shape: Sequence[int],
    steps: int = 50,
    eta: float = 0.0,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    x_T: Tensor | None = None,
    clip_x0: bool = True,
    progress: bool = False,
) -> Tensor:
    """DDIM (Song et al. 2021, arXiv:2010.02502, eq. 12; guided-diffusion ``ddim_sample``) on ``steps``
    timesteps evenly spaced over ``[0, T-1]`` (rounded, both ends included; ``steps = 1`` is just T-1):
    ``x_prev = sqrt(ᾱ_prev) x̂0 + sqrt(1 - ᾱ_prev - σ²) ε̂ + σ z`` with
    ``σ = eta · sqrt((1-ᾱ_prev)/(1-ᾱ)) · sqrt(1 - ᾱ/ᾱ_prev)`` and ``ᾱ_prev = 1`` after the last step;
    ``ε̂`` is re-derived from the (clipped) ``x̂0``. ``eta = 0`` draws no noise, so the result depends
    only on ``x_T``; ``eta = 1`` matches DDPM's variance. Other arguments as :func:`ddpm_sample`.

    Raises ValueError when ``steps`` is not in ``[1, T]`` or ``eta < 0``.
    """
    T = diffusion.num_timesteps
    if not 1 <= steps <= T:
        raise ValueError(f"steps must be in [1, {T}], got {steps}")
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    x, device = _start(shape, generator, device, x_T)
    batch = x.shape[0]
    ts = [T - 1] if steps == 1 else [int(k * (T - 1) / (steps - 1) + 0.5) for k in range(steps)]
    ac = diffusion.alphas_cumprod.detach().cpu().tolist()
    for k in _steps(range(len(ts) - 1, -1, -1), progress):
        i = ts[k]
        a, a_prev = ac[i], (ac[ts[k - 1]] if k > 0 else 1.0)
        t = torch.full((batch,), i, dtype=torch.long, device=device)
        pred_x0 = diffusion.p_mean_variance(model_fn(x, t), x, t, clip_x0=clip_x0)["pred_x0"]
        eps = diffusion.eps_from_x0(x, t, pred_x0)
        sigma = eta * math.sqrt((1 - a_prev) / (1 - a)) * math.sqrt(1 - a / a_prev)
        x = math.sqrt(a_prev) * pred_x0 + math.sqrt(max(1 - a_prev - sigma**2, 0.0)) * eps
        if sigma > 0:
            x = x + sigma * torch.randn(x.shape, generator=generator, device=device, dtype=x.dtype)
    return x
