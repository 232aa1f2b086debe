"""The code-id kinds of masked generative transformers (MaskGIT / Muse, ``mmformer.tasks.maskgit``):
tokenizer kind ``vq_codes`` (a frozen trained VQ codec's ids + ``[MASK]``, with a class token or a caption
prefix: ``mmformer.tokenizers.codes.MaskedCodeTokenizer``) and head kind ``codes`` (logits over the
codebook). Registered when the ``maskgit`` task kind is (``components.tasks.maskgit`` imports this file).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from omegaconf import MISSING

from ..errors import RecipeError, positive, probability
from ..models.heads import MLMHead
from ..registry import register
from ..tokenizers.codes import MaskedCodeTokenizer
from .backbones import require_position_biases
from .context import BuildContext
from .heads import readers
from .vq import load_frozen_codec


@dataclass
class VQCodesConfig:
    """``model.tokenizers.<name>`` of kind ``vq_codes``: images → the code ids of the frozen VQ codec in
    ``checkpoint`` (a trained ``vq`` run's ``.ckpt``, ``mmformer.tokenizers.vq.load_vq``) → embeddings
    over the ``codebook_size`` codes + ``[MASK]`` with learned positions. ``image_size`` / ``in_chans`` /
    ``codebook_size`` are what the recipe expects of the codec (the data side reads the images at that
    size): a codec of other sizes is refused at build with both named."""

    modality: ClassVar[str] = "image"
    kind: str = "vq_codes"
    checkpoint: str = MISSING
    image_size: int = 28
    in_chans: int = 1
    codebook_size: Optional[int] = None  # None: whatever the codec has
    num_classes: Optional[int] = None  # class-conditional: a class token (+ a null class)
    text_conditional: bool = False  # a caption prefix (the task's caption_tokenizer + projector)
    cond_dropout: float = 0.1  # classifier-free guidance: P(class / caption → null) in training

    def __post_init__(self) -> None:
        positive(self, "image_size", "codebook_size", "num_classes")
        probability(self, "cond_dropout")
        if self.in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 (grayscale) or 3 (RGB), got {self.in_chans}")


@dataclass
class CodesHeadConfig:
    """``model.heads.<name>`` of kind ``codes``: logits over a ``vq_codes`` tokenizer's codebook (BERT's /
    MaskGIT's MLM layer: dense, GELU, LayerNorm, decoder with a bias, ``mmformer.models.heads.MLMHead``),
    the decoder tied to the code embedding when ``tie_weights`` (the ``[MASK]`` row's logit is dropped
    by the task)."""

    kind: str = "codes"
    tie_weights: bool = True

    def check(self, recipe, where: str) -> None:
        if any(recipe.model.tokenizers[t].kind != "vq_codes" for t in readers(recipe, where)):
            raise RecipeError(f"'{where}': a 'codes' head reads the tokens of a tokenizer of kind vq_codes")


@register("tokenizer", "vq_codes", VQCodesConfig)
def build_vq_codes(cfg: VQCodesConfig, d_model: int, ctx: BuildContext, name: str) -> MaskedCodeTokenizer:
    codec = load_frozen_codec(cfg, name)
    tokenizer = MaskedCodeTokenizer(d_model, codec, cfg.num_classes, cfg.cond_dropout, cfg.text_conditional)
    if ctx.recipe is not None:  # the grid is the codec's: known once it is loaded, before any step
        require_code_biases(ctx.recipe, name, tokenizer)
    return tokenizer


def require_code_biases(recipe, name: str, tokenizer: MaskedCodeTokenizer) -> None:
    """Refuses an AFT kernel (``kernel_options.max_len``) with position biases for fewer tokens than the
    backbone reads per sequence from tokenizer ``name``: the codec's grid of codes, after its class token
    and / or the longest caption prefix of a task reading captions with it (``data.max_len``)."""
    captions = [
        getattr(task.data, "max_len", 0)
        for task in recipe.tasks.values()
        if getattr(task, "tokenizer", None) == name and getattr(task, "caption_tokenizer", None) is not None
    ]
    caption = max(captions, default=0) if tokenizer.null_text is not None else 0
    h, w = tokenizer.grid
    what = f"its codec's {h}×{w} grid of codes"
    what += f" after a caption prefix of up to {caption}" if tokenizer.null_text is not None else ""
    what += " and its class token" if tokenizer.num_prefix_tokens else ""
    n_tokens = caption + tokenizer.num_prefix_tokens + tokenizer.num_codes
    require_position_biases(recipe, name, n_tokens, f"'model.tokenizers.{name}' ({what})")


@register("head", "codes", CodesHeadConfig)
def build_codes_head(cfg: CodesHeadConfig, d_model: int, tokenizer, ctx: BuildContext) -> MLMHead:
    if not isinstance(tokenizer, MaskedCodeTokenizer):
        raise RecipeError("a 'codes' head reads the tokens of a tokenizer of kind vq_codes")
    head = MLMHead(d_model, tokenizer.codebook_size + 1)  # + [MASK], whose logit the task drops
    if cfg.tie_weights:
        head.tie_to(tokenizer.tok_embed)
    return head
