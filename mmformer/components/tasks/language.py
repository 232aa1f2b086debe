"""Task kinds ``causal_lm`` (next-token prediction, perplexity; ``mmformer.tasks.language_model``) and
``masked_lm`` (BERT's masked language modelling; ``mmformer.tasks.masked_lm``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING

from ...errors import RecipeError
from ...registry import register
from ...tasks.language_model import CausalLMTask
from ...tasks.masked_lm import MaskedLMTask
from ..context import BuildContext
from .base import TaskConfigParts


@dataclass
class CausalLMTaskConfig(TaskConfigParts):
    """``tasks.<name>`` of kind ``causal_lm``: next-token prediction, perplexity."""

    shards: ClassVar[str | None] = "text"
    kind: str = "causal_lm"
    weight: float = 1.0
    tokenizer: str = MISSING
    head: str = MISSING
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class MaskedLMTaskConfig(TaskConfigParts):
    """``tasks.<name>`` of kind ``masked_lm``: BERT's masked language modelling (``mask_prob`` of the real
    tokens chosen, 80/10/10 [MASK] / random / kept, loss on the chosen ones), on a bidirectional backbone;
    validation: masked-token accuracy, loss, perplexity (``mmformer.tasks.masked_lm``)."""

    shards: ClassVar[str | None] = "text"
    kind: str = "masked_lm"
    weight: float = 1.0
    tokenizer: str = MISSING
    head: str = MISSING  # an mlm (or lm) head
    mask_prob: float = 0.15
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {self.mask_prob}")

    def check(self, recipe, where: str) -> None:
        if getattr(recipe.model.backbone, "causal", False):
            raise RecipeError(
                f"'{where}': a masked_lm task needs a bidirectional backbone: set model.backbone.causal: false"
            )


@register("task", "causal_lm", CausalLMTaskConfig)
def build_causal_lm(cfg: CausalLMTaskConfig, ctx: BuildContext) -> CausalLMTask:
    return CausalLMTask(cfg.tokenizer, cfg.head)


@register("task", "masked_lm", MaskedLMTaskConfig)
def build_masked_lm(cfg: MaskedLMTaskConfig, ctx: BuildContext) -> MaskedLMTask:
    tok = ctx.text_tokenizer(cfg.tokenizer)
    if tok.mask_id is None:
        raise RecipeError(
            f"'model.tokenizers.{cfg.tokenizer}' has no mask token: use a BPE trained by mmformer (a masked_lm "
            "task adds <|mask|>) or a BERT tokenizer"
        )
    specials = [
        i
        for i in (tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id, tok.image_id, tok.audio_id)
        if i is not None
    ]
    return MaskedLMTask(
        cfg.tokenizer, cfg.head, tok.mask_id, tok.vocab_size, specials, cfg.mask_prob, ctx.recipe.seed
    )
