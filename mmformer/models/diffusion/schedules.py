"""Noise schedules and the discrete Gaussian diffusion process (DDPM), kept apart from the network.

Follows Ho et al. 2020 (DDPM, arXiv:2006.11239), Nichol & Dhariwal 2021 (Improved DDPM,
arXiv:2102.09672) and their reference code, openai/guided-diffusion ``gaussian_diffusion.py`` (also
copied into facebookresearch/DiT ``diffusion/gaussian_diffusion.py``).

Shape legend: B batch, C channels, ``*`` any trailing (spatial) dims; ``t`` is a LongTensor ``(B,)`` of
integer steps in ``[0, T)`` where step ``t`` is the guided-diffusion index (the paper's ``t + 1``), so
``alphas_cumprod[0] = 1 - betas[0]``. Data ``x0`` is expected in ``[-1, 1]`` (images scaled so).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

BETA_SCHEDULES = ("linear", "cosine")
PREDICTIONS = ("eps", "v")


def beta_schedule(
    kind: str, num_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 2e-2
) -> Tensor:
    """Variances ``β_t``, float64 ``(T,)``.

    ``"linear"``: ``linspace(beta_start, beta_end, T)`` (DDPM §4; guided-diffusion additionally rescales
    both ends by ``1000 / T``, pass scaled values to get that). ``"cosine"``: ``β_t = 1 - ᾱ(t+1)/ᾱ(t)``
    with ``ᾱ(t) = f(t)/f(0)``, ``f(t) = cos²((t/T + s)/(1 + s) · π/2)``, ``s = 0.008``, clipped at 0.999
    (Improved DDPM §3.2, guided-diffusion ``betas_for_alpha_bar``); ``beta_start``/``beta_end`` unused.

    Raises ValueError for an unknown ``kind`` or ``num_timesteps < 1``.
    """
    if num_timesteps < 1:
        raise ValueError(f"num_timesteps must be >= 1, got {num_timesteps}")
    if kind == "linear":
        return torch.linspace(beta_start, beta_end, num_timesteps, dtype=torch.float64)
    if kind == "cosine":
        s = 0.008
        steps = torch.arange(num_timesteps + 1, dtype=torch.float64) / num_timesteps
        f = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
        return (1 - f[1:] / f[:-1]).clamp(max=0.999)
    raise ValueError(f"unknown beta schedule {kind!r}; choose one of {BETA_SCHEDULES}")


def normal_kl(mean1: Tensor, logvar1: Tensor, mean2: Tensor, logvar2: Tensor) -> Tensor:
    """Elementwise ``KL(N(mean1, exp(logvar1)) ‖ N(mean2, exp(logvar2)))`` in nats (guided-diffusion
    ``losses.normal_kl``); arguments broadcast."""
    return 0.5 * (
        -1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2)
    )


def _approx_standard_normal_cdf(x: Tensor) -> Tensor:
    # The tanh approximation guided-diffusion uses, kept for parity with its reported bits/dim.
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def discretized_gaussian_log_likelihood(x: Tensor, means: Tensor, log_scales: Tensor) -> Tensor:
    """Elementwise log-probability (nats) of 8-bit data ``x`` in ``[-1, 1]`` under a Gaussian discretized
    into 256 bins of width 2/255, the edge bins extended to ±∞ (DDPM §3.3, guided-diffusion
    ``losses.discretized_gaussian_log_likelihood``). ``log_scales`` is the log standard deviation."""
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = _approx_standard_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = _approx_standard_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_cdf_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta))


def _mean_flat(x: Tensor) -> Tensor:
    return x.flatten(1).mean(dim=1)


class GaussianDiffusion(nn.Module):
    """The forward process ``q(x_t | x0) = N(sqrt(ᾱ_t) x0, (1 - ᾱ_t) I)``, its posterior, the model's
    reverse Gaussian and the training loss.

    Args:
        betas: ``(T,)`` variances in ``(0, 1]``, e.g. from :func:`beta_schedule`.
        prediction: what the network predicts: ``"eps"`` (the noise ε, DDPM) or ``"v"``
            (``v = sqrt(ᾱ) ε - sqrt(1 - ᾱ) x0``, Salimans & Ho 2022 §4, arXiv:2202.00512).
        learned_variance: the network outputs ``2C`` channels, the last ``C`` an interpolation value
            in ``[-1, 1]`` between ``log β_t`` (+1) and the clipped log posterior variance (-1)
            (Improved DDPM §3.1, guided-diffusion ``LEARNED_RANGE``); otherwise the reverse variance is
            the posterior variance β̃_t (guided-diffusion ``FIXED_SMALL``).

    The schedule tables are float64 buffers (non-persistent: derived from ``betas``, not saved in a
    ``state_dict``); every method gathers the rows it needs and computes in the input's dtype and on
    its device, whether or not the module was moved.

    Raises ValueError for an unknown ``prediction`` or betas not 1-D in ``(0, 1]``.
    """

    def __init__(
        self, betas: Tensor | Sequence[float], prediction: str = "eps", learned_variance: bool = False
    ):
        super().__init__()
        if prediction not in PREDICTIONS:
            raise ValueError(f"unknown prediction {prediction!r}; choose one of {PREDICTIONS}")
        betas = torch.as_tensor(betas, dtype=torch.float64).detach().cpu()
        if betas.ndim != 1 or len(betas) == 0 or not bool(((betas > 0) & (betas <= 1)).all()):
            raise ValueError("betas must be a non-empty 1-D sequence of values in (0, 1]")
        self.prediction = prediction
        self.learned_variance = learned_variance

        alphas = 1.0 - betas
        ac = torch.cumprod(alphas, dim=0)
        ac_prev = torch.cat([ac.new_ones(1), ac[:-1]])
        post_var = betas * (1.0 - ac_prev) / (1.0 - ac)
        # β̃_0 = 0; log-variance there is clipped to log β̃_1 (guided-diffusion), or log β_0 when T = 1.
        post_var_for_log = torch.cat([post_var[1:2] if len(betas) > 1 else betas[:1], post_var[1:]])
        tables = {
            "betas": betas,
            "alphas_cumprod": ac,
            "alphas_cumprod_prev": ac_prev,
            "sqrt_alphas_cumprod": ac.sqrt(),
            "sqrt_one_minus_alphas_cumprod": (1.0 - ac).sqrt(),
            "sqrt_recip_alphas_cumprod": (1.0 / ac).sqrt(),
            "sqrt_recipm1_alphas_cumprod": (1.0 / ac - 1.0).sqrt(),
            "log_betas": betas.log(),
            "posterior_variance": post_var,
            "posterior_log_variance_clipped": post_var_for_log.log(),
            "posterior_mean_coef1": betas * ac_prev.sqrt() / (1.0 - ac),
            "posterior_mean_coef2": (1.0 - ac_prev) * alphas.sqrt() / (1.0 - ac),
        }
        for name, value in tables.items():
            self.register_buffer(name, value, persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """``.to(device)`` moves the tables; ``.to(dtype)`` / ``.half()`` (``precision: bf16-true``) leave
        them float64: each value is converted only where it is used (``_extract``)."""
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        return self

    @property
    def num_timesteps(self) -> int:
        """``T``, the number of diffusion steps."""
        return self.betas.shape[0]

    def _extract(self, name: str, t: Tensor, like: Tensor) -> Tensor:
        """Rows ``t`` of table ``name`` as ``(B, 1, ..., 1)`` in ``like``'s dtype and device."""
        table = getattr(self, name)
        values = table[t.to(table.device)].to(device=like.device, dtype=like.dtype)
        return values.reshape(-1, *([1] * (like.ndim - 1)))

    def _split(self, model_output: Tensor, channels: int) -> tuple[Tensor, Tensor | None]:
        """``(mean prediction (B, C, *), interpolation values (B, C, *) or None)``."""
        if self.learned_variance:
            if model_output.shape[1] != 2 * channels:
                raise ValueError(
                    f"learned variance needs {2 * channels} output channels, got {model_output.shape[1]}"
                )
            return model_output[:, :channels], model_output[:, channels:]
        if model_output.shape[1] != channels:
            raise ValueError(f"expected {channels} output channels, got {model_output.shape[1]}")
        return model_output, None

    def _mean_part(self, model_output: Tensor, channels: int) -> Tensor:
        if self.learned_variance and model_output.shape[1] == 2 * channels:
            return model_output[:, :channels]
        return model_output

    # Forward process ---------------------------------------------------------------------------------

    def q_sample(self, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """``x_t = sqrt(ᾱ_t) x0 + sqrt(1 - ᾱ_t) ε`` (DDPM eq. 4), shape of ``x0``."""
        return (
            self._extract("sqrt_alphas_cumprod", t, x0) * x0
            + self._extract("sqrt_one_minus_alphas_cumprod", t, x0) * noise
        )

    def q_mean_variance(self, x0: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """Mean ``sqrt(ᾱ_t) x0`` and variance ``1 - ᾱ_t`` of ``q(x_t | x0)``, both shaped like ``x0``
        (the variance an expanded view)."""
        mean = self._extract("sqrt_alphas_cumprod", t, x0) * x0
        variance = (1.0 - self._extract("alphas_cumprod", t, x0)).expand_as(x0)
        return mean, variance

    def q_posterior(self, x0: Tensor, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``q(x_{t-1} | x_t, x0)`` (DDPM eq. 6–7): mean ``μ̃ = β_t sqrt(ᾱ_{t-1})/(1-ᾱ_t) x0 +
        (1-ᾱ_{t-1}) sqrt(α_t)/(1-ᾱ_t) x_t``, variance ``β̃_t = (1-ᾱ_{t-1})/(1-ᾱ_t) β_t`` (0 at t = 0) and
        its log clipped at t = 0 to ``log β̃_1``; all shaped like ``x_t`` (variances expanded views)."""
        mean = (
            self._extract("posterior_mean_coef1", t, x_t) * x0
            + self._extract("posterior_mean_coef2", t, x_t) * x_t
        )
        variance = self._extract("posterior_variance", t, x_t).expand_as(x_t)
        log_variance = self._extract("posterior_log_variance_clipped", t, x_t).expand_as(x_t)
        return mean, variance, log_variance

    # Parameterisations -------------------------------------------------------------------------------

    def predict_x0(self, x_t: Tensor, t: Tensor, model_output: Tensor) -> Tensor:
        """``x0`` from the network's prediction: ``(x_t - sqrt(1-ᾱ) ε̂)/sqrt(ᾱ)`` for ε,
        ``sqrt(ᾱ) x_t - sqrt(1-ᾱ) v̂`` for v. ``model_output`` is ``(B, C, *)`` or, with learned
        variance, ``(B, 2C, *)`` of which the first C channels are used."""
        pred = self._mean_part(model_output, x_t.shape[1])
        if self.prediction == "eps":
            return (
                self._extract("sqrt_recip_alphas_cumprod", t, x_t) * x_t
                - self._extract("sqrt_recipm1_alphas_cumprod", t, x_t) * pred
            )
        return (
            self._extract("sqrt_alphas_cumprod", t, x_t) * x_t
            - self._extract("sqrt_one_minus_alphas_cumprod", t, x_t) * pred
        )

    def predict_eps(self, x_t: Tensor, t: Tensor, model_output: Tensor) -> Tensor:
        """``ε`` from the network's prediction: itself for ε, ``sqrt(1-ᾱ) x_t + sqrt(ᾱ) v̂`` for v.
        Channels as in :meth:`predict_x0`."""
        pred = self._mean_part(model_output, x_t.shape[1])
        if self.prediction == "eps":
            return pred
        return (
            self._extract("sqrt_one_minus_alphas_cumprod", t, x_t) * x_t
            + self._extract("sqrt_alphas_cumprod", t, x_t) * pred
        )

    def eps_from_x0(self, x_t: Tensor, t: Tensor, x0: Tensor) -> Tensor:
        """``ε = (x_t / sqrt(ᾱ) - x0) / sqrt(1/ᾱ - 1)`` (guided-diffusion ``_predict_eps_from_xstart``)."""
        return (self._extract("sqrt_recip_alphas_cumprod", t, x_t) * x_t - x0) / self._extract(
            "sqrt_recipm1_alphas_cumprod", t, x_t
        )

    def training_target(self, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        """What the mean half of the output regresses to: ``ε`` or ``v = sqrt(ᾱ) ε - sqrt(1-ᾱ) x0``."""
        if self.prediction == "eps":
            return noise
        return (
            self._extract("sqrt_alphas_cumprod", t, x0) * noise
            - self._extract("sqrt_one_minus_alphas_cumprod", t, x0) * x0
        )

    def snr(self, t: Tensor) -> Tensor:
        """Signal-to-noise ratio ``ᾱ_t / (1 - ᾱ_t)``, float64 ``(B,)`` on ``t``'s device."""
        ac = self.alphas_cumprod[t.to(self.alphas_cumprod.device)]
        return (ac / (1.0 - ac)).to(t.device)

    # Reverse process ---------------------------------------------------------------------------------

    def p_mean_variance(
        self, model_output: Tensor, x_t: Tensor, t: Tensor, clip_x0: bool = True
    ) -> dict[str, Tensor]:
        """The model's ``p(x_{t-1} | x_t) = N(mean, variance)`` (guided-diffusion ``p_mean_variance``):
        ``pred_x0`` from the mean half (clamped to ``[-1, 1]`` when ``clip_x0``), ``mean`` the posterior
        mean given ``pred_x0``; ``log_variance`` is ``frac · log β_t + (1 - frac) · log β̃_t(clipped)``,
        ``frac = (v + 1)/2``, with learned variance, else the clipped log posterior variance
        (``variance`` is then β̃_t, 0 at t = 0). All four are shaped like ``x_t``.

        Raises ValueError when the output's channel count does not fit ``learned_variance``.
        """
        pred, var_values = self._split(model_output, x_t.shape[1])
        if var_values is None:
            variance = self._extract("posterior_variance", t, x_t).expand_as(x_t)
            log_variance = self._extract("posterior_log_variance_clipped", t, x_t).expand_as(x_t)
        else:
            min_log = self._extract("posterior_log_variance_clipped", t, x_t)
            max_log = self._extract("log_betas", t, x_t)
            frac = (var_values + 1) / 2
            log_variance = frac * max_log + (1 - frac) * min_log
            variance = torch.exp(log_variance)
        pred_x0 = self.predict_x0(x_t, t, pred)
        if clip_x0:
            pred_x0 = pred_x0.clamp(-1, 1)
        mean, _, _ = self.q_posterior(pred_x0, x_t, t)
        return {"mean": mean, "variance": variance, "log_variance": log_variance, "pred_x0": pred_x0}

    # Losses ------------------------------------------------------------------------------------------

    def vlb(self, model_output: Tensor, x0: Tensor, x_t: Tensor, t: Tensor, clip_x0: bool = False) -> Tensor:
        """Variational-bound term ``L_{t}``, bits per dim, ``(B,)`` (guided-diffusion ``_vb_terms_bpd``):
        ``KL(q(x_{t-1}|x_t,x0) ‖ p(x_{t-1}|x_t))`` for t > 0, the discretized-Gaussian decoder NLL of
        ``x0`` (in ``[-1, 1]``) for t = 0. Both are ≥ 0."""
        true_mean, _, true_log_var = self.q_posterior(x0, x_t, t)
        out = self.p_mean_variance(model_output, x_t, t, clip_x0=clip_x0)
        kl = _mean_flat(normal_kl(true_mean, true_log_var, out["mean"], out["log_variance"])) / math.log(2.0)
        nll = -discretized_gaussian_log_likelihood(x0, out["mean"], 0.5 * out["log_variance"])
        nll = _mean_flat(nll) / math.log(2.0)
        return torch.where(t.to(kl.device) == 0, nll, kl)

    def loss(
        self, model_output: Tensor, x0: Tensor, noise: Tensor, t: Tensor, min_snr_gamma: float | None = None
    ) -> Tensor:
        """Per-sample loss ``(B,)``: MSE of the mean half against :meth:`training_target`, averaged over
        all non-batch dims, times the min-SNR-γ weight when ``min_snr_gamma`` is given (Hang et al.
        2023, arXiv:2303.09556: ``min(SNR, γ)/SNR`` for ε, ``min(SNR, γ)/(SNR + 1)`` for v). With learned
        variance, plus :meth:`vlb` computed on the output whose mean half is detached, so the bound
        trains only the variance (Improved DDPM's hybrid objective, λ = 1 as in DiT; the weight applies
        to the MSE only). ``x0`` and ``noise`` are ``(B, C, *)``; ``x0`` in ``[-1, 1]`` for the bound.

        Raises ValueError when the output's channel count does not fit ``learned_variance``.
        """
        pred, var_values = self._split(model_output, x0.shape[1])
        mse = _mean_flat((pred - self.training_target(x0, noise, t)) ** 2)
        if min_snr_gamma is not None:
            snr = self.snr(t).to(device=mse.device)
            denom = snr if self.prediction == "eps" else snr + 1.0
            mse = mse * (snr.clamp(max=min_snr_gamma) / denom).to(mse.dtype)
        if var_values is None:
            return mse
        frozen = torch.cat([pred.detach(), var_values], dim=1)
        return mse + self.vlb(frozen, x0, self.q_sample(x0, t, noise), t, clip_x0=False)
