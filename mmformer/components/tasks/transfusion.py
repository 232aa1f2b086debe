"""Task kind ``transfusion``: caption–image pairs as one mixed sequence through the shared causal backbone,
the LM loss on the text and the diffusion / flow loss on the image (Zhou et al. 2024;
``mmformer.tasks.transfusion``, ``mmformer.models.transfusion``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from omegaconf import MISSING

from ...errors import RecipeError, non_negative_weight, positive, probability
from ...models.transfusion import SAMPLERS, Transfusion
from ...registry import register
from ...tasks.transfusion import TransfusionTask
from ..backbones import require_kernel_rules
from ..context import BuildContext
from .base import CaptionedTaskParts, check_captions
from .diffusion import build_process, check_process_choices


@dataclass
class TransfusionTaskConfig(CaptionedTaskParts):
    """``tasks.<name>`` of kind ``transfusion``: images (``tokenizer``, kind ``dit``, unconditional: its
    timestep embedding is added to every patch) and captions (``caption_tokenizer``, a BPE that gets
    ``<boi>`` / ``<eoi>``) in one sequence — ``bos caption <boi> image <eoi> eos`` or image first — read
    out by ``lm_head`` (kind ``lm``) on the text and ``image_head`` (kind ``dit``) on the patches.

    ``image_weight``: λ of ``L_LM + λ · L_image`` (5, Transfusion §4.1). ``caption_first``: the share of
    caption-first pairs (0.8, §4.1); ``image_first_max_t``: the noise cap of the image-first pairs as a
    fraction of the schedule (0.5 = t ≤ 500 of 1,000, §4.3); ``caption_dropout``: caption-free
    caption-first pairs for classifier-free guidance. ``context``: the longest row in tokens (text +
    patches); ``pack``: several pairs per row, each its own document. ``objective: gaussian`` (the
    paper's DDPM: ε, cosine schedule, 1,000 steps) or ``flow`` (rectified flow)."""

    image_markers: ClassVar[bool] = True  # the caption tokenizer's vocabulary gets <boi> / <eoi>
    kind: str = "transfusion"
    weight: float = 1.0
    tokenizer: str = MISSING  # a model.tokenizers entry of kind dit (unconditional)
    caption_tokenizer: str = MISSING  # a bpe text tokenizer
    lm_head: str = MISSING  # a model.heads entry of kind lm
    image_head: str = MISSING  # a model.heads entry of kind dit
    context: int = 128
    pack: bool = False
    image_weight: float = 5.0
    caption_first: float = 0.8
    image_first_max_t: float = 0.5
    caption_dropout: float = 0.1
    objective: str = "gaussian"  # gaussian | flow
    num_timesteps: int = 1000
    beta_schedule: str = "cosine"  # linear | cosine
    prediction: str = "eps"  # eps | v
    min_snr_gamma: Optional[float] = None
    t_sampling: str = "uniform"  # flow: uniform | logit_normal
    # the media after each validation (and the defaults of `mmformer sample`)
    sampler: Optional[str] = None  # ddim | ddpm (gaussian), euler | heun (flow); default ddim / euler
    sample_cfg_scale: float = 3.0
    sample_steps: int = 25
    samples_per_caption: int = 8
    sample_captions: int = 8
    max_new_tokens: int = 24
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_process_choices(self)
        if self.sampler is not None and self.sampler not in SAMPLERS[self.objective]:
            raise ValueError(
                f"sampler={self.sampler!r} does not fit objective {self.objective}; choose {SAMPLERS[self.objective]}"
            )
        positive(self, "context", "num_timesteps", "sample_steps", "samples_per_caption", "sample_captions")
        positive(self, "max_new_tokens", "sample_cfg_scale", "min_snr_gamma")
        probability(self, "caption_first", "caption_dropout")
        if not 0 < self.image_first_max_t <= 1:
            raise ValueError(
                f"image_first_max_t={self.image_first_max_t}: a fraction of the schedule in (0, 1]"
            )
        if self.image_weight < 0:
            raise ValueError(f"image_weight={self.image_weight} must be >= 0")
        non_negative_weight(self)

    def head_refs(self) -> dict[str, tuple[str, str]]:
        return {
            "lm_head": (self.lm_head, self.caption_tokenizer),
            "image_head": (self.image_head, self.tokenizer),
        }

    def check(self, recipe, where: str) -> None:
        m = recipe.model
        check_captions(self, recipe, where)
        tok, lm, img = m.tokenizers[self.tokenizer], m.heads[self.lm_head], m.heads[self.image_head]
        if tok.kind != "dit" or img.kind != "dit" or lm.kind != "lm":
            raise RecipeError(
                f"'{where}': a transfusion task needs a tokenizer of kind dit, an image_head of kind dit and an "
                f"lm_head of kind lm; got {tok.kind}, {img.kind}, {lm.kind}"
            )
        if tok.num_classes or tok.text_conditional:
            raise RecipeError(
                f"'{where}': the image is conditioned by the text before it in the sequence: set "
                f"model.tokenizers.{self.tokenizer}.num_classes: null and text_conditional: false"
            )
        if getattr(img, "learn_sigma", False):
            raise RecipeError(f"'{where}': learn_sigma is not supported by the transfusion task")
        bb = m.backbone
        if bb.kind != "transformer" or not bb.causal or bb.block == "adaln":
            raise RecipeError(
                "a transfusion task generates text over a causal backbone of pre-norm blocks (the timestep is "
                "added to the patches): set model.backbone.causal: true and a block other than adaln"
            )
        needs = frozenset({"padding", "causal", "documents", "spans", "cache"})
        require_kernel_rules(bb, needs, "a transfusion task needs")
        patches = (tok.image_size // tok.patch_size) ** 2
        if self.context < patches + 4:
            raise RecipeError(
                f"'{where}.context'={self.context}: an image of {patches} patches needs {patches + 4} tokens with "
                "bos, <boi>, <eoi> and eos"
            )
        text_len = getattr(m.tokenizers[self.caption_tokenizer], "max_len", None)
        if text_len is not None and text_len < self.context:
            raise RecipeError(
                f"model.tokenizers.{self.caption_tokenizer}.max_len={text_len}: the text's learned positions "
                f"count the whole sequence; it must be >= {where}.context={self.context} (or null with RoPE)"
            )


@register("task", "transfusion", TransfusionTaskConfig)
def build_transfusion(cfg: TransfusionTaskConfig, ctx: BuildContext) -> TransfusionTask:
    text = ctx.text_tokenizer(cfg.caption_tokenizer)
    if getattr(text, "boi_id", None) is None or getattr(text, "eoi_id", None) is None:
        raise RecipeError(
            f"the text tokenizer {cfg.caption_tokenizer!r} has no <boi> / <eoi>: a transfusion task needs a "
            "bpe tokenizer trained by mmformer (no path), which adds them"
        )
    parts = Transfusion(
        cfg.tokenizer,
        cfg.caption_tokenizer,
        cfg.lm_head,
        cfg.image_head,
        text.boi_id,
        text.eoi_id,
        text.bos_id,
        text.eos_id,
        text.pad_id,
        cfg.context,
    )
    return TransfusionTask(
        parts,
        build_process(cfg),
        text,
        image_weight=cfg.image_weight,
        caption_first=cfg.caption_first,
        image_first_max_t=cfg.image_first_max_t,
        caption_dropout=cfg.caption_dropout,
        pack=cfg.pack,
        min_snr_gamma=cfg.min_snr_gamma,
        sample_cfg_scale=cfg.sample_cfg_scale,
        sample_steps=cfg.sample_steps,
        sampler=cfg.sampler,
        samples_per_caption=cfg.samples_per_caption,
        sample_captions=cfg.sample_captions,
        max_new_tokens=cfg.max_new_tokens,
    )
