"""Modality tokenizers: each has a data-side half (per sample) and a model-side ``nn.Module``
(per batch) that returns ``Tokens``."""

from typing import Protocol, runtime_checkable

from torch import Tensor

from ..nn.tokens import Tokens
from .image import ImagePreprocess, PatchEmbed, ViTPatchTokenizer
from .text import SPECIAL_TOKENS, TextEmbedding, TextTokenizer


@runtime_checkable
class Tokenizer(Protocol):
    """Anything that turns a batch tensor into Tokens (model side)."""

    modality: str
    num_prefix_tokens: int

    def __call__(self, inputs: Tensor) -> Tokens: ...


__all__ = [
    "Tokenizer",
    "ImagePreprocess",
    "PatchEmbed",
    "ViTPatchTokenizer",
    "SPECIAL_TOKENS",
    "TextEmbedding",
    "TextTokenizer",
]
