"""Rectified flow / flow matching with the straight (linear) path between data and noise.

Liu et al. 2022 (rectified flow, arXiv:2209.03003), Lipman et al. 2023 (flow matching,
arXiv:2210.02747), with the logit-normal time sampling of SD3 (Esser et al. 2024, arXiv:2403.03206,
§3.1). Convention (as SD3): ``x_t = (1 - t) x0 + t ε``, ``t ∈ [0, 1]`` continuous, t = 0 data, t = 1
noise; the network predicts the velocity ``u = dx_t/dt = ε - x0``.

Shape legend: B batch, ``*`` any trailing dims; ``t`` is a float tensor ``(B,)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...progress import progress

T_SAMPLINGS = ("uniform", "logit_normal")

VelocityFn = Callable[[Tensor, Tensor], Tensor]


def _steps(ts: list[float], bar: bool):
    """``(t, t_next)`` pairs of ``ts``, with a progress bar (``mmformer.progress``) when ``bar``."""
    pairs = list(zip(ts[:-1], ts[1:]))
    return progress(pairs, "sampling", unit="step") if bar else pairs


def _bcast(t: Tensor, like: Tensor) -> Tensor:
    return t.to(device=like.device, dtype=like.dtype).reshape(-1, *([1] * (like.ndim - 1)))


class RectifiedFlow:
    """The linear noising path, its velocity target and loss, and ODE samplers from t = 1 to t = 0.

    Args:
        t_sampling: training-time distribution of t: ``"uniform"`` on ``[0, 1)`` or ``"logit_normal"``
            (``sigmoid(n)``, ``n ~ N(logit_mean, logit_std²)``, SD3 §3.1 uses mean 0, std 1).
        logit_mean, logit_std: parameters of the logit-normal.

    Raises ValueError for an unknown ``t_sampling`` or ``logit_std <= 0``.
    """

    def __init__(self, t_sampling: str = "uniform", logit_mean: float = 0.0, logit_std: float = 1.0):
        if t_sampling not in T_SAMPLINGS:
            raise ValueError(f"unknown t_sampling {t_sampling!r}; choose one of {T_SAMPLINGS}")
        if logit_std <= 0:
            raise ValueError(f"logit_std must be > 0, got {logit_std}")
        self.t_sampling = t_sampling
        self.logit_mean = logit_mean
        self.logit_std = logit_std

    def sample_t(
        self, batch: int, generator: torch.Generator | None = None, device: torch.device | str | None = None
    ) -> Tensor:
        """Training times, float32 ``(batch,)`` in ``[0, 1]``."""
        if self.t_sampling == "uniform":
            return torch.rand(batch, generator=generator, device=device)
        n = torch.randn(batch, generator=generator, device=device)
        return torch.sigmoid(self.logit_mean + self.logit_std * n)

    def interpolate(self, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        """``x_t = (1 - t) x0 + t ε``, shape of ``x0``; ``x0`` at t = 0 and ``ε`` at t = 1."""
        t = _bcast(t, x0)
        return (1 - t) * x0 + t * noise

    def target(self, x0: Tensor, noise: Tensor) -> Tensor:
        """Velocity target ``u = ε - x0`` (independent of t on the straight path)."""
        return noise - x0

    def loss(self, model_output: Tensor, x0: Tensor, noise: Tensor) -> Tensor:
        """Per-sample flow-matching loss ``(B,)``: MSE against :meth:`target`, mean over non-batch dims."""
        return ((model_output - self.target(x0, noise)) ** 2).flatten(1).mean(dim=1)

    @staticmethod
    def _start(shape, generator, device, x_1: Tensor | None) -> Tensor:
        if x_1 is not None:
            return x_1
        if device is None:
            device = generator.device if generator is not None else "cpu"
        return torch.randn(tuple(shape), generator=generator, device=device)

    @torch.no_grad()
    def euler_sample(
        self,
        model_fn: VelocityFn,
        shape: Sequence[int],
        steps: int = 50,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        x_1: Tensor | None = None,
        bar: bool = False,
    ) -> Tensor:
        """Integrate ``dx/dt = v(x, t)`` from t = 1 (``x_1``, default a standard-normal draw of ``shape``)
        to t = 0 with ``steps`` uniform Euler steps; ``model_fn(x, t)`` gets float ``t (B,)`` in ``x``'s
        dtype. Returns a sample ``(B, *)`` at t = 0. ``bar``: a progress bar over the steps.

        Raises ValueError when ``steps < 1``.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        x = self._start(shape, generator, device, x_1)
        ts = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()
        for t_cur, t_next in _steps(ts, bar):
            t = torch.full((x.shape[0],), t_cur, dtype=x.dtype, device=x.device)
            x = x + (t_next - t_cur) * model_fn(x, t)
        return x

    @torch.no_grad()
    def heun_sample(
        self,
        model_fn: VelocityFn,
        shape: Sequence[int],
        steps: int = 50,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        x_1: Tensor | None = None,
        bar: bool = False,
    ) -> Tensor:
        """As :meth:`euler_sample` with Heun's second-order correction (the average of the velocities at
        both ends of each step, Karras et al. 2022 Algorithm 1); the last step, ending at t = 0, is plain
        Euler, so ``2 · steps - 1`` model calls.

        Raises ValueError when ``steps < 1``.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        x = self._start(shape, generator, device, x_1)
        ts = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()
        for t_cur, t_next in _steps(ts, bar):
            t = torch.full((x.shape[0],), t_cur, dtype=x.dtype, device=x.device)
            v = model_fn(x, t)
            x_euler = x + (t_next - t_cur) * v
            if t_next > 0:
                v_next = model_fn(x_euler, torch.full_like(t, t_next))
                x = x + (t_next - t_cur) * 0.5 * (v + v_next)
            else:
                x = x_euler
        return x
