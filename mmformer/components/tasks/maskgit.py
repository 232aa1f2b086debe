"""Task kind ``maskgit``: MaskGIT / Muse over a frozen VQ codec's code grid (``mmformer.tasks.maskgit``; the
schedule and parallel decoding in ``mmformer.models.maskgit``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from ...errors import RecipeError, non_negative_weight, positive
from ...registry import register
from ...tasks.maskgit import MaskGITTask
from .. import codes  # noqa: F401  (registers the vq_codes tokenizer and codes head this task reads)
from ..context import BuildContext
from .optional_captions import OptionalCaptionParts, check_caption_tokenizer


@dataclass
class MaskGITTaskConfig(OptionalCaptionParts):
    """``tasks.<name>`` of kind ``maskgit``: predict cosine-masked VQ codes of the task's images with a
    bidirectional backbone (Chang et al. 2022), conditioned on a class token (the tokenizer's
    ``num_classes``) or on a caption prefix — ``caption_tokenizer`` (text, its own frozen tower) and
    ``projector`` (a head of kind ``projector``: tower width → backbone width). Sampled by iterative
    parallel decoding in ``sample_steps`` rounds with guidance ``sample_cfg_scale``."""

    kind: str = "maskgit"
    weight: float = 1.0
    tokenizer: str = MISSING  # a model.tokenizers entry of kind vq_codes
    head: str = MISSING  # a model.heads entry of kind codes
    data: dict[str, Any] = field(default_factory=dict)
    caption_tokenizer: Optional[str] = None  # text-conditional: the text tokenizer reading captions
    projector: Optional[str] = None  # text-conditional: a head of kind projector
    label_smoothing: float = 0.1  # MaskGIT reference
    # the sample grid logged after each validation
    sample_cfg_scale: float = 3.0
    sample_steps: int = 8
    samples_per_class: int = 8
    temperature: float = 1.0  # token sampling (0 = argmax)
    choice_temperature: float = 4.5  # Gumbel noise on confidences, annealed to 0 (MaskGIT reference)

    def __post_init__(self) -> None:
        positive(self, "sample_steps", "samples_per_class")
        for name in ("sample_cfg_scale", "temperature", "choice_temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        non_negative_weight(self)

    def head_refs(self) -> dict[str, tuple[str, str]]:
        refs = {"head": (self.head, self.tokenizer)}
        if self.projector is not None:
            refs["projector"] = (self.projector, self.caption_tokenizer)
        return refs

    def check(self, recipe, where: str) -> None:
        m = recipe.model
        tok, head = m.tokenizers[self.tokenizer], m.heads[self.head]
        if tok.kind != "vq_codes" or head.kind != "codes":
            raise RecipeError(
                f"'{where}': task kind 'maskgit' needs a tokenizer of kind vq_codes and a head of kind codes, "
                f"got {tok.kind}, {head.kind}"
            )
        bb = m.backbone
        if getattr(bb, "causal", False) or getattr(bb, "block", "pre") not in ("pre", "post"):
            raise RecipeError(
                "a maskgit task predicts every masked code from the whole grid: the backbone must be "
                "bidirectional pre- or post-norm blocks (causal: false, block: pre)"
            )
        text = self.caption_tokenizer is not None
        if tok.text_conditional != text:
            raise RecipeError(
                "a text-conditional MaskGIT needs both the tokenizer's text_conditional: true and the task's "
                "caption_tokenizer"
            )
        check_caption_tokenizer(self, recipe, where)
        if text:
            if self.projector is None or m.heads[self.projector].kind != "projector":
                raise RecipeError(
                    f"'{where}.projector': a text-conditional MaskGIT maps the caption encoder's states to the "
                    "backbone with a model.heads entry of kind projector"
                )
            if self.caption_tokenizer not in m.towers:
                raise RecipeError(
                    f"the captions of a maskgit task are read by a text encoder of their own: add "
                    f"model.towers.{self.caption_tokenizer} (e.g. the pretrained all-minilm-l6-v2, frozen)"
                )
        elif self.projector is not None:
            raise RecipeError(f"'{where}.projector' applies to a text-conditional task (caption_tokenizer)")
        conditional = bool(tok.num_classes) or text
        if conditional and tok.cond_dropout == 0 and self.sample_cfg_scale != 1:
            raise RecipeError(
                "classifier-free guidance (sample_cfg_scale != 1) needs the null condition trained: set the "
                f"tokenizer's cond_dropout > 0 (e.g. 0.1) or {where}.sample_cfg_scale: 1"
            )
        if not conditional and self.sample_cfg_scale != 1:
            raise RecipeError(f"'{where}.sample_cfg_scale' != 1 needs a condition (num_classes or captions)")


@register("task", "maskgit", MaskGITTaskConfig)
def build_maskgit(cfg: MaskGITTaskConfig, ctx: BuildContext) -> MaskGITTask:
    tok = ctx.recipe.model.tokenizers[cfg.tokenizer]
    return MaskGITTask(
        cfg.tokenizer,
        cfg.head,
        caption_tokenizer=cfg.caption_tokenizer,
        projector=cfg.projector,
        label_smoothing=cfg.label_smoothing,
        sample_cfg_scale=cfg.sample_cfg_scale,
        sample_steps=cfg.sample_steps,
        samples_per_class=cfg.samples_per_class,
        temperature=cfg.temperature,
        choice_temperature=cfg.choice_temperature,
        conditional=bool(tok.num_classes or tok.text_conditional) and tok.cond_dropout > 0,
    )
