"""Leaf layers: Tokens, masks, attention, positions, MLPs, norms, blocks. Imports torch only."""

from .attention import KERNELS, Attention, AttentionInputs, KVCache, eager_attention
from .blocks import AdaLNBlock, Block, CrossAttentionBlock, DropPath, LayerScale, PostNormBlock
from .masks import MaskSpec, to_additive, to_ignore
from .mlp import Mlp, SwiGLU, build_mlp
from .norms import build_norm
from .positions import RotaryEmbedding, alibi_bias, alibi_slopes, resample_pos_embed, sinusoidal
from .tokens import MODALITY_IDS, ConditionedTokens, Tokens, cat_tokens

__all__ = [
    "KERNELS",
    "Attention",
    "AttentionInputs",
    "KVCache",
    "eager_attention",
    "AdaLNBlock",
    "Block",
    "CrossAttentionBlock",
    "DropPath",
    "LayerScale",
    "PostNormBlock",
    "MaskSpec",
    "to_additive",
    "to_ignore",
    "Mlp",
    "SwiGLU",
    "build_mlp",
    "build_norm",
    "RotaryEmbedding",
    "alibi_bias",
    "alibi_slopes",
    "resample_pos_embed",
    "sinusoidal",
    "MODALITY_IDS",
    "ConditionedTokens",
    "Tokens",
    "cat_tokens",
]
