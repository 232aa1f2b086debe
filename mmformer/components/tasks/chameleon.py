"""Task kind ``chameleon`` (Chameleon-style early fusion: captions and VQ image codes in one vocabulary,
one next-token loss; ``mmformer.tasks.chameleon``, ``mmformer.models.chameleon``) and the tokenizer kind
it reads, ``chameleon``: the joint-vocabulary embedding (a BPE over the captions + the codes of a frozen
VQ codec + ``<boi>`` / ``<eoi>``). The tokenizer kind is registered here, beside the only task that reads
it, because its vocabulary exists only for this objective."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from omegaconf import MISSING

from ...errors import RecipeError, non_negative_weight, positive, probability
from ...models.chameleon import ChameleonLM, JointEmbedding, JointVocab, text_room
from ...registry import register
from ...tasks.chameleon import ChameleonTask
from ..backbones import require_kernel_rules
from ..context import BuildContext
from ..vq import load_frozen_codec
from .base import TaskConfigParts


@dataclass
class ChameleonTokenizerConfig:
    """``model.tokenizers.<name>`` of kind ``chameleon``: one embedding table over the joint vocabulary
    ``[BPE text ids | K image codes | <boi> | <eoi>]`` (``mmformer.models.chameleon.JointEmbedding``).

    The image codes come from the frozen VQ codec in ``checkpoint`` (a trained ``vq`` run's ``.ckpt``,
    ``mmformer.tokenizers.vq.load_vq``); ``image_size`` / ``in_chans`` / ``codebook_size`` are what the
    recipe expects of it (the data side reads the images at that size): a codec of other sizes is
    refused at build with both named. The BPE is ``path`` (a ``tokenizer.json``), else one of
    ``vocab_size`` trained on the training captions. ``context``: the longest sequence in tokens (it
    must hold ``bos <boi>`` + the ``h·w`` codes + ``<eoi> eos``; a longer caption is cut, counted);
    ``learned_positions``: GPT-2's learned absolute positions (leave false with a RoPE backbone)."""

    modality: ClassVar[str] = "text"
    kind: str = "chameleon"
    checkpoint: str = MISSING
    image_size: int = 28
    in_chans: int = 1
    codebook_size: Optional[int] = None  # None: whatever the codec has
    context: int = 96
    learned_positions: bool = False
    path: Optional[str] = None
    vocab_size: int = 1024

    def __post_init__(self) -> None:
        positive(self, "image_size", "codebook_size", "context", "vocab_size")
        if self.in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 (grayscale) or 3 (RGB), got {self.in_chans}")


@dataclass
class ChameleonTaskConfig(TaskConfigParts):
    """``tasks.<name>`` of kind ``chameleon``: caption ↔ image as one token sequence over the joint
    vocabulary of ``tokenizer`` (kind ``chameleon``), read out by ``head`` (kind ``lm``), one next-token
    loss, causal backbone. ``image_first_prob``: share of training rows in the image → caption order;
    ``caption_dropout``: share of caption → image rows whose caption is dropped (classifier-free
    guidance). The grid after each validation, ``sample`` and ``caption`` use the ``sample_*`` settings
    and ``max_new_tokens``. Reads ``image_caption`` data."""

    kind: str = "chameleon"
    weight: float = 1.0
    tokenizer: str = MISSING  # a model.tokenizers entry of kind chameleon
    head: str = MISSING  # an lm head over its vocabulary
    image_first_prob: float = 0.5
    caption_dropout: float = 0.1
    sample_cfg_scale: float = 3.0
    sample_temperature: float = 1.0
    sample_top_k: Optional[int] = None
    samples_per_caption: int = 8
    sample_captions: int = 8
    max_new_tokens: int = 16
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def caption_tokenizer(self) -> str:
        """The captions are read by the joint tokenizer's BPE (what ``image_caption`` data asks for)."""
        return self.tokenizer

    def __post_init__(self) -> None:
        probability(self, "caption_dropout")
        if not 0.0 <= self.image_first_prob <= 1.0:
            raise ValueError(f"image_first_prob must be in [0, 1], got {self.image_first_prob}")
        if self.sample_cfg_scale < 0 or self.sample_temperature < 0:
            raise ValueError(
                f"sample_cfg_scale and sample_temperature must be >= 0, got {self.sample_cfg_scale}, "
                f"{self.sample_temperature}"
            )
        positive(self, "sample_top_k", "samples_per_caption", "sample_captions", "max_new_tokens")
        non_negative_weight(self)

    def check(self, recipe, where: str) -> None:
        m = recipe.model
        tok, head = m.tokenizers[self.tokenizer], m.heads[self.head]
        if tok.kind != "chameleon":
            raise RecipeError(
                f"'{where}.tokenizer' {self.tokenizer!r} must be of kind chameleon, got {tok.kind}"
            )
        if head.kind != "lm":
            raise RecipeError(f"'{where}.head' {self.head!r} must be an lm head over the joint vocabulary")
        if m.backbone.kind == "pretrained" or not m.backbone.causal:
            raise RecipeError(
                f"'{where}': a chameleon task generates token by token: set model.backbone.causal: true"
            )
        if m.backbone.bidirectional:
            raise RecipeError(
                f"'{where}': Chameleon attends causally throughout (images too): drop model.backbone.bidirectional"
            )
        require_kernel_rules(
            m.backbone, frozenset({"causal", "cache"}), "a chameleon task needs: it samples from a KV cache"
        )
        kind = self.data.get("kind") if isinstance(self.data, dict) else getattr(self.data, "kind", None)
        if kind != "image_caption":
            raise RecipeError(f"'{where}.data': a chameleon task reads image_caption data")
        if self.sample_cfg_scale != 1 and self.caption_dropout == 0 and self.image_first_prob == 0:
            raise RecipeError(
                f"'{where}': classifier-free guidance (sample_cfg_scale != 1) needs the unconditional image "
                "model trained: set caption_dropout > 0 or image_first_prob > 0, or sample_cfg_scale: 1"
            )


@register("tokenizer", "chameleon", ChameleonTokenizerConfig)
def build_chameleon_tokenizer(
    cfg: ChameleonTokenizerConfig, d_model: int, ctx: BuildContext, name: str
) -> JointEmbedding:
    codec = load_frozen_codec(cfg, name)
    vocab = JointVocab(ctx.text_tokenizer(name).vocab_size, int(codec.codebook_size), tuple(codec.grid))
    try:
        text_room(vocab, cfg.context)
    except ValueError as e:
        raise RecipeError(f"'model.tokenizers.{name}.context': {e}") from None
    return JointEmbedding(vocab, codec, d_model, cfg.context, cfg.learned_positions)


@register("task", "chameleon", ChameleonTaskConfig)
def build_chameleon(cfg: ChameleonTaskConfig, ctx: BuildContext) -> ChameleonTask:
    tok = ctx.recipe.model.tokenizers[cfg.tokenizer]
    grid = load_frozen_codec(tok, cfg.tokenizer).grid  # the codes per image loss_units counts (a small file)
    return ChameleonTask(
        ChameleonLM(cfg.tokenizer, cfg.head),
        ctx.text_tokenizer(cfg.tokenizer),
        grid[0] * grid[1],
        tok.context,
        image_first_prob=cfg.image_first_prob,
        caption_dropout=cfg.caption_dropout,
        sample_cfg_scale=cfg.sample_cfg_scale,
        sample_temperature=cfg.sample_temperature,
        sample_top_k=cfg.sample_top_k,
        samples_per_caption=cfg.samples_per_caption,
        sample_captions=cfg.sample_captions,
        max_new_tokens=cfg.max_new_tokens,
    )
