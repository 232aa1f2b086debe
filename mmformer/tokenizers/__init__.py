"""Modality tokenizers: each has a data-side half (per sample) and a model-side ``nn.Module``
(per batch) that returns ``Tokens`` (DESIGN.md, "The one idea")."""

from typing import Protocol, runtime_checkable

from torch import Tensor

from ..nn.tokens import Tokens
from .image import ImagePreprocess, PatchEmbed, ViTPatchTokenizer
from .text import SPECIAL_TOKENS, TextEmbedding, TextTokenizer


@runtime_checkable
class Tokenizer(Protocol):
    """The model side of a modality tokenizer: a batch tensor (and the keyword arguments of its kind:
    a padding ``valid`` mask, a DiT's timesteps and labels) → ``Tokens`` of the backbone's width, every
    field filled; a conditioning tokenizer returns ``ConditionedTokens`` (Tokens + ``cond (B, D_c)``).

    Attributes:
        modality: the ``MODALITY_IDS`` key stamped on its tokens (``text``, ``image``, ``audio``, …).
        num_prefix_tokens: leading tokens that are not content (a class token): heads' mean pooling
            skips them.

    ``example_input(batch_size)`` gives an input of the expected shape (FLOP counting, smoke tests).
    ``isinstance(module, Tokenizer)`` checks that these members exist, not their signatures.
    """

    modality: str
    num_prefix_tokens: int

    def forward(self, inputs: Tensor, *args, **kwargs) -> Tokens: ...

    def example_input(self, batch_size: int = 1) -> Tensor: ...


__all__ = [
    "Tokenizer",
    "ImagePreprocess",
    "PatchEmbed",
    "ViTPatchTokenizer",
    "SPECIAL_TOKENS",
    "TextEmbedding",
    "TextTokenizer",
]
