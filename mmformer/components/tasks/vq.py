"""Task kind ``vq``: train the VQ-VAE codec of a ``vq`` tokenizer to reconstruct the task's images
(``mmformer.tasks.vq``; the codec in ``mmformer.tokenizers.vq``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from ...errors import RecipeError, non_negative_weight, positive
from ...registry import register
from ...tasks.vq import VQTask
from ..context import BuildContext
from .optional_captions import OptionalCaptionParts, check_caption_tokenizer


@dataclass
class VQTaskConfig(OptionalCaptionParts):
    """``tasks.<name>`` of kind ``vq``: reconstruction MSE + codebook term + β · commitment term
    (van den Oord et al. 2017, eq. 3) through the codec of ``tokenizer`` (kind ``vq``, no checkpoint).
    The backbone and heads are not used: the recipe's backbone can be the smallest there is.

    ``caption_tokenizer``: only for ``image_caption`` data (emoji), which is read with one; the captions
    are not used."""

    kind: str = "vq"
    weight: float = 1.0
    tokenizer: str = MISSING  # a model.tokenizers entry of kind vq
    data: dict[str, Any] = field(default_factory=dict)
    caption_tokenizer: Optional[str] = None
    commitment_cost: float = 0.25  # β
    media_images: int = 16  # held-out images shown beside their reconstructions after each validation

    def __post_init__(self) -> None:
        positive(self, "commitment_cost", "media_images")
        non_negative_weight(self)

    def head_refs(self) -> dict[str, tuple[str, str]]:
        return {}  # the codec is the whole model

    def check(self, recipe, where: str) -> None:
        tok = recipe.model.tokenizers[self.tokenizer]
        if tok.kind != "vq":
            raise RecipeError(
                f"'{where}': task kind 'vq' trains a tokenizer of kind vq; {self.tokenizer!r} is {tok.kind}"
            )
        check_caption_tokenizer(self, recipe, where)
        strategy = recipe.trainer.strategy
        if strategy.startswith("ddp") and not strategy.endswith("find_unused_parameters_true"):
            raise RecipeError(
                f"'{where}': a vq task leaves the backbone unused, which DDP must be told: set "
                f"trainer.strategy={strategy}_find_unused_parameters_true"
            )


@register("task", "vq", VQTaskConfig)
def build_vq(cfg: VQTaskConfig, ctx: BuildContext) -> VQTask:
    tok = ctx.recipe.model.tokenizers[cfg.tokenizer]
    return VQTask(cfg.tokenizer, tok.codebook_size, cfg.commitment_cost, media_images=cfg.media_images)
