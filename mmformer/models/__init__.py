"""Backbone, heads, the composed model, size presets, FLOP counting. Imports torch only
(timm lazily, inside the adapters that need it)."""

from .backbone import Backbone, build_backbone
from .backbone_config import (
    AttentionConfig,
    BigBirdConfig,
    BlockConfig,
    LongContextConfig,
    MlpConfig,
    PositionConfig,
)
from .flops import count_flops
from .heads import ClassifierHead, ProjectionHead
from .model import MultimodalModel
from .pair_head import PairClassifierHead
from .presets import PRESETS, preset

__all__ = [
    "Backbone",
    "build_backbone",
    "AttentionConfig",
    "BigBirdConfig",
    "BlockConfig",
    "LongContextConfig",
    "MlpConfig",
    "PositionConfig",
    "ClassifierHead",
    "PairClassifierHead",
    "ProjectionHead",
    "MultimodalModel",
    "PRESETS",
    "preset",
    "count_flops",
]
