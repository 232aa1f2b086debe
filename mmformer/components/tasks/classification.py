"""Task kind ``classification``: cross-entropy on a head's logits, accuracy (``mmformer.tasks.classification``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING

from ...errors import RecipeError, non_negative_weight, probability
from ...registry import register
from ...tasks import ClassificationTask
from ..context import BuildContext
from .base import TaskConfigParts


@dataclass
class ClassificationTaskConfig(TaskConfigParts):
    """``tasks.<name>`` of kind ``classification``: cross-entropy on a head's logits, accuracy."""

    shards: ClassVar[str | None] = "labelled"
    kind: str = "classification"
    weight: float = 1.0
    tokenizer: str = MISSING  # a model.tokenizers entry
    head: str = MISSING  # a model.heads entry
    data: dict[str, Any] = field(default_factory=dict)
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        probability(self, "label_smoothing")
        non_negative_weight(self)


@register("task", "classification", ClassificationTaskConfig)
def build_classification(cfg: ClassificationTaskConfig, ctx: BuildContext) -> ClassificationTask:
    key = ctx.tokenizer_modality(ctx.recipe.model.tokenizers[cfg.tokenizer])
    num_classes = ctx.num_classes(cfg)
    if num_classes is None:
        raise RecipeError(f"the classification head {cfg.head!r} has no num_classes")
    return ClassificationTask(cfg.tokenizer, cfg.head, num_classes, key, cfg.label_smoothing)
