"""Task kind ``prefix_lm``: captioning or speech recognition with images / audio as a bidirectional prefix
of the shared causal backbone (``mmformer.tasks.prefix_lm``, ``mmformer.models.prefix_lm``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from ...errors import RecipeError
from ...models.prefix_lm import PrefixLM
from ...registry import register
from ...tasks.prefix_lm import PrefixLMTask
from ..context import BuildContext
from ..tokenizers import modality_at_load
from .base import CaptionedTaskParts, check_captions, check_decoding, decoding_args


@dataclass
class PrefixLMTaskConfig(CaptionedTaskParts):
    """``tasks.<name>`` of kind ``prefix_lm``: captioning or speech recognition — the inputs
    (``tokenizer``: image or audio) as a bidirectional prefix, their caption (``caption_tokenizer``, text)
    generated causally after it through the shared causal backbone and read out by ``caption_head`` (an
    LM head). ``projector``: a head of kind ``projector`` mapping the prefix tokenizer's own tower (a
    pretrained encoder) to the backbone's width (LLaVA). Validation decodes the held-out text (greedy
    with ``beam_size: 1``, else beam search) and reports ``wer``, ``cer`` and ``exact_match``
    (``mmformer.tasks.prefix_lm``)."""

    kind: str = "prefix_lm"
    weight: float = 1.0
    tokenizer: str = MISSING  # image or audio tokenizer: the prefix
    caption_tokenizer: str = MISSING  # text tokenizer
    caption_head: str = MISSING  # its LM head
    projector: Optional[str] = None  # a model.heads entry of kind projector (tower → backbone width)
    beam_size: int = 1  # 1 = greedy decoding
    length_penalty: float = 1.0
    max_new_tokens: Optional[int] = None  # default: data.max_len - 1
    main_metric: Optional[str] = (
        None  # wer | cer | exact_match; default: wer for audio, exact_match for images
    )
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_decoding(self)

    def head_refs(self) -> dict[str, tuple[str, str]]:
        refs = {"caption_head": (self.caption_head, self.caption_tokenizer)}
        if self.projector is not None:
            refs["projector"] = (self.projector, self.tokenizer)
        return refs

    def check(self, recipe, where: str) -> None:
        m = recipe.model
        check_captions(self, recipe, where)
        if (
            modality_at_load(m.tokenizers[self.tokenizer]) == "text"
            or m.tokenizers[self.tokenizer].kind == "dit"
        ):
            raise RecipeError(
                f"'{where}.tokenizer' {self.tokenizer!r} cannot be a prefix: a prefix_lm task reads images or audio"
            )
        if m.heads[self.caption_head].kind not in ("lm", "pretrained"):
            raise RecipeError(
                f"'{where}.caption_head' {self.caption_head!r} is of kind {m.heads[self.caption_head].kind}; "
                "a prefix_lm task needs an LM head (kind: lm or pretrained)"
            )
        if self.caption_tokenizer in m.towers:
            raise RecipeError(
                "the text of a prefix_lm task runs through the shared backbone: drop "
                f"model.towers.{self.caption_tokenizer}"
            )
        if m.backbone.kind != "pretrained" and not m.backbone.causal:
            raise RecipeError("a prefix_lm task generates text: set model.backbone.causal: true")
        if self.projector is not None:
            if m.heads[self.projector].kind != "projector":
                raise RecipeError(
                    f"'{where}.projector' {self.projector!r} must be a model.heads entry of kind projector"
                )
            if self.tokenizer not in m.towers:
                raise RecipeError(
                    f"a projector maps a tower's output to the backbone: model.towers.{self.tokenizer} is missing"
                )


@register("task", "prefix_lm", PrefixLMTaskConfig)
def build_prefix_lm(cfg: PrefixLMTaskConfig, ctx: BuildContext) -> PrefixLMTask:
    modality = ctx.tokenizer_modality(ctx.recipe.model.tokenizers[cfg.tokenizer])
    if modality == "text":  # a pretrained source the recipe alone could not tell
        raise RecipeError(
            f"tokenizer {cfg.tokenizer!r} cannot be a prefix: a prefix_lm task reads images or audio"
        )
    model = PrefixLM(cfg.tokenizer, cfg.caption_tokenizer, cfg.caption_head, cfg.projector)
    return PrefixLMTask(model, modality, *decoding_args(cfg, ctx, modality))
