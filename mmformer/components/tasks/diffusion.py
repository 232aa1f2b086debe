"""Task kind ``diffusion``: train a DiT to denoise the task's images (``mmformer.tasks.diffusion``; the
noising math in ``mmformer.models.diffusion``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from ...errors import RecipeError, non_negative_weight, positive
from ...models.diffusion import GaussianDiffusion, RectifiedFlow, beta_schedule
from ...registry import register
from ...tasks.diffusion import DiffusionTask
from ..context import BuildContext
from ..tokenizers import modality_at_load
from .optional_captions import OptionalCaptionParts

PROCESS_CHOICES = {
    "objective": ("gaussian", "flow"),
    "beta_schedule": ("linear", "cosine"),
    "prediction": ("eps", "v"),
    "t_sampling": ("uniform", "logit_normal"),
}


def check_process_choices(cfg) -> None:
    """The noising-process keys of a task config (kinds ``diffusion``, ``transfusion``) are among
    ``PROCESS_CHOICES``; raises ``ValueError`` naming the key, its value and the choices."""
    for name, allowed in PROCESS_CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"{name}={getattr(cfg, name)!r}; choose {' | '.join(allowed)}")


def build_process(cfg, learned_variance: bool = False, **betas: float) -> GaussianDiffusion | RectifiedFlow:
    """``RectifiedFlow(cfg.t_sampling)`` for ``objective: flow``, else ``GaussianDiffusion`` over
    ``cfg.num_timesteps`` steps of the ``cfg.beta_schedule`` (``betas``: ``beta_start`` / ``beta_end``,
    default ``beta_schedule``'s) with ``cfg.prediction``."""
    if cfg.objective == "flow":
        return RectifiedFlow(cfg.t_sampling)
    schedule = beta_schedule(cfg.beta_schedule, cfg.num_timesteps, **betas)
    return GaussianDiffusion(schedule, cfg.prediction, learned_variance=learned_variance)


@dataclass
class DiffusionTaskConfig(OptionalCaptionParts):
    """``tasks.<name>`` of kind ``diffusion``: train a DiT to denoise the task's images.

    ``objective: gaussian`` — DDPM (Ho et al. 2020) with a ``linear`` or ``cosine`` β schedule over
    ``num_timesteps``, ``eps`` or ``v`` prediction, optional min-SNR-γ weighting; sampled with DDIM or
    DDPM. ``objective: flow`` — rectified flow (Liu et al. 2022), t ``uniform`` or ``logit_normal``;
    sampled with Euler or Heun."""

    kind: str = "diffusion"
    weight: float = 1.0
    tokenizer: str = MISSING  # a model.tokenizers entry of kind dit
    head: str = MISSING  # a model.heads entry of kind dit
    data: dict[str, Any] = field(default_factory=dict)
    caption_tokenizer: Optional[str] = None  # text-conditional: the text tokenizer that reads captions
    objective: str = "gaussian"  # gaussian | flow
    num_timesteps: int = 1000
    beta_schedule: str = "linear"  # linear | cosine
    beta_start: float = 1e-4
    beta_end: float = 0.02
    prediction: str = "eps"  # eps | v
    min_snr_gamma: Optional[float] = None  # e.g. 5.0
    t_sampling: str = "uniform"  # flow: uniform | logit_normal
    # the sample grid logged after each validation
    sample_cfg_scale: float = 4.0
    sample_steps: int = 50
    samples_per_class: int = 8

    def __post_init__(self) -> None:
        check_process_choices(self)
        positive(
            self, "num_timesteps", "sample_steps", "samples_per_class", "sample_cfg_scale", "min_snr_gamma"
        )
        if not 0 < self.beta_start < self.beta_end < 1:
            raise ValueError(f"need 0 < beta_start < beta_end < 1, got {self.beta_start}, {self.beta_end}")
        non_negative_weight(self)

    def check(self, recipe, where: str) -> None:
        tok, head = recipe.model.tokenizers[self.tokenizer], recipe.model.heads[self.head]
        if tok.kind != "dit" or head.kind != "dit":
            raise RecipeError(
                f"'{where}': task kind 'diffusion' needs a tokenizer and a head of kind dit, "
                f"got {tok.kind}, {head.kind}"
            )
        bb = recipe.model.backbone
        if bb.kind == "transformer" and bb.block != "adaln":
            raise RecipeError("a diffusion task conditions through adaLN: set model.backbone.block: adaln")
        if bb.kind == "transformer" and bb.d_cond not in (None, bb.d_model):
            raise RecipeError(
                f"model.backbone.d_cond={bb.d_cond}: the DiT tokenizer's conditioning has d_model width"
            )
        if tok.text_conditional != (self.caption_tokenizer is not None):
            raise RecipeError(
                "a text-conditional DiT needs both the tokenizer's text_conditional: true and the task's "
                "caption_tokenizer (a text tokenizer in model.tokenizers)"
            )
        if self.caption_tokenizer is not None:
            if modality_at_load(recipe.model.tokenizers[self.caption_tokenizer]) not in ("text", None):
                raise RecipeError(
                    f"caption_tokenizer {self.caption_tokenizer!r} must be a text tokenizer (bpe)"
                )
        if (
            (tok.num_classes or tok.text_conditional)
            and tok.class_dropout == 0
            and self.sample_cfg_scale != 1
        ):
            raise RecipeError(
                "classifier-free guidance (sample_cfg_scale != 1) needs the null class trained: set the "
                f"tokenizer's class_dropout > 0 (e.g. 0.1) or {where}.sample_cfg_scale: 1"
            )
        defaults = DiffusionTaskConfig(tokenizer="", head="")
        if self.objective == "flow":
            gaussian = (
                "num_timesteps",
                "beta_schedule",
                "beta_start",
                "beta_end",
                "prediction",
                "min_snr_gamma",
            )
            ignored = [k for k in gaussian if getattr(self, k) != getattr(defaults, k)]
            if ignored:
                raise RecipeError(f"{', '.join(ignored)} apply to objective: gaussian, not flow; remove them")
            if head.learn_sigma:
                raise RecipeError(
                    "learn_sigma is for objective: gaussian (rectified flow has no variance to learn)"
                )
        elif self.t_sampling != defaults.t_sampling:
            raise RecipeError("t_sampling applies to objective: flow; remove it")
        elif self.sample_steps > self.num_timesteps:
            raise RecipeError(f"sample_steps={self.sample_steps} exceeds num_timesteps={self.num_timesteps}")


@register("task", "diffusion", DiffusionTaskConfig)
def build_diffusion(cfg: DiffusionTaskConfig, ctx: BuildContext) -> DiffusionTask:
    tok, head = ctx.recipe.model.tokenizers[cfg.tokenizer], ctx.recipe.model.heads[cfg.head]
    process = build_process(
        cfg, learned_variance=head.learn_sigma, beta_start=cfg.beta_start, beta_end=cfg.beta_end
    )
    return DiffusionTask(
        cfg.tokenizer,
        cfg.head,
        process,
        cfg.min_snr_gamma,
        sample_cfg_scale=cfg.sample_cfg_scale,
        sample_steps=cfg.sample_steps,
        samples_per_class=cfg.samples_per_class,
        caption_tokenizer=cfg.caption_tokenizer,
        conditional=bool(tok.num_classes or tok.text_conditional) and tok.class_dropout > 0,
    )
