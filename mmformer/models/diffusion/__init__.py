"""The diffusion *process*, kept apart from the network: noise schedules and the discrete Gaussian
diffusion (DDPM / Improved DDPM, ε- or v-prediction, optional learned variance), its samplers (DDPM,
DDIM, classifier-free guidance), and rectified flow. Pure torch."""

from .flow import RectifiedFlow
from .samplers import ModelFn, ddim_sample, ddpm_sample, guided
from .schedules import GaussianDiffusion, beta_schedule, discretized_gaussian_log_likelihood, normal_kl

__all__ = [
    "beta_schedule",
    "GaussianDiffusion",
    "normal_kl",
    "discretized_gaussian_log_likelihood",
    "ModelFn",
    "guided",
    "ddpm_sample",
    "ddim_sample",
    "RectifiedFlow",
]
