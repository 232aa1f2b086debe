"""Leaf layers: Tokens, masks, attention, MLP, blocks. Imports torch only."""

from .attention import KERNELS, Attention, eager_attention
from .blocks import Block, DropPath
from .masks import MaskSpec, to_additive, to_ignore
from .mlp import Mlp
from .tokens import MODALITY_IDS, Tokens, cat_tokens

__all__ = [
    "KERNELS",
    "Attention",
    "eager_attention",
    "Block",
    "DropPath",
    "MaskSpec",
    "to_additive",
    "to_ignore",
    "Mlp",
    "MODALITY_IDS",
    "Tokens",
    "cat_tokens",
]
