"""Task kind ``seq2seq``: an encoder–decoder whose encoder is the source tokenizer's tower and whose
decoder is the shared backbone with cross-attention (``mmformer.tasks.seq2seq``,
``mmformer.models.encoder_decoder``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from ...errors import RecipeError
from ...models.encoder_decoder import EncoderDecoder
from ...registry import register
from ...tasks.seq2seq import Seq2SeqTask
from ..backbones import require_kernel_rules
from ..context import BuildContext
from .base import CaptionedTaskParts, check_captions, check_decoding, decoding_args


@dataclass
class Seq2SeqTaskConfig(CaptionedTaskParts):
    """``tasks.<name>`` of kind ``seq2seq``: an encoder–decoder (``mmformer.models.encoder_decoder``) —
    the source (``tokenizer``: audio, image or text) is encoded by its own tower (``model.towers``), the
    shared backbone is the decoder (``block: cross``, ``causal: true``) that generates the target text
    (``caption_tokenizer``) read out by ``caption_head`` (an LM head). Teacher forcing in training;
    validation decodes with the KV cache (greedy with ``beam_size: 1``, else beam search) and reports
    ``wer``, ``cer``, ``exact_match``, ``loss`` and ``ppl`` as ``prefix_lm`` does."""

    kind: str = "seq2seq"
    weight: float = 1.0
    tokenizer: str = MISSING  # the source's tokenizer; model.towers.<it> is the encoder
    caption_tokenizer: str = MISSING  # the target text's tokenizer
    caption_head: str = MISSING  # its LM head
    beam_size: int = 1  # 1 = greedy decoding
    length_penalty: float = 1.0
    max_new_tokens: Optional[int] = None  # default: data.max_len - 1
    main_metric: Optional[str] = None  # wer | cer | exact_match; default: wer for audio, else exact_match
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_decoding(self)

    def head_refs(self) -> dict[str, tuple[str, str]]:
        return {"caption_head": (self.caption_head, self.caption_tokenizer)}

    def check(self, recipe, where: str) -> None:
        m = recipe.model
        check_captions(self, recipe, where)
        if m.tokenizers[self.tokenizer].kind == "dit":
            raise RecipeError(
                f"'{where}.tokenizer' {self.tokenizer!r} cannot be a source: it returns a conditioning vector"
            )
        if self.tokenizer not in m.towers:
            raise RecipeError(
                f"a seq2seq task encodes its source with that tokenizer's own tower: add model.towers.{self.tokenizer} "
                "(the encoder; the shared model.backbone is the decoder)"
            )
        if self.caption_tokenizer in m.towers:
            raise RecipeError(
                f"the target text of a seq2seq task runs through the decoder (the shared backbone): drop "
                f"model.towers.{self.caption_tokenizer}"
            )
        if m.heads[self.caption_head].kind not in ("lm", "pretrained"):
            raise RecipeError(
                f"'{where}.caption_head' {self.caption_head!r} is of kind {m.heads[self.caption_head].kind}; "
                "a seq2seq task needs an LM head (kind: lm or pretrained)"
            )
        b = m.backbone
        if b.kind == "pretrained":
            if getattr(b, "part", None) != "decoder":
                raise RecipeError(
                    "a seq2seq task's decoder is the shared backbone with cross-attention blocks: a pretrained "
                    f"one is an encoder–decoder's decoder — set model.backbone.part: decoder ({b.source} must be "
                    "one, e.g. whisper-tiny.en), or use model.backbone: {block: cross, causal: true, …}"
                )
            return
        if b.block != "cross" or not b.causal:
            raise RecipeError(
                "a seq2seq task's decoder is the shared backbone: set model.backbone.block: cross and causal: true"
            )
        why = "a seq2seq task's decoder needs: it decodes from a KV cache at every validation"
        require_kernel_rules(b, frozenset({"causal", "cache"}), why)
        tower = m.towers[self.tokenizer]
        d_tower, d_context = getattr(tower, "d_model", None), b.d_context or b.d_model
        if tower.kind != "pretrained" and d_tower != d_context:
            raise RecipeError(
                f"model.towers.{self.tokenizer} is {d_tower} wide but the decoder's cross-attention reads "
                f"{d_context}: set model.backbone.d_context: {d_tower}"
            )


@register("task", "seq2seq", Seq2SeqTaskConfig)
def build_seq2seq(cfg: Seq2SeqTaskConfig, ctx: BuildContext) -> Seq2SeqTask:
    """The target text starts with its tokenizer's ``start_ids`` (``bos``, or Whisper's prompt); a
    pretrained decoder's text keeps its source's decoding rules (Whisper's ``suppress_ids`` every step,
    ``suppress_ids_begin`` at the first)."""
    m = ctx.recipe.model
    modality = ctx.tokenizer_modality(m.tokenizers[cfg.tokenizer])
    model = EncoderDecoder(cfg.tokenizer, cfg.caption_tokenizer, cfg.caption_head)
    text = m.tokenizers[cfg.caption_tokenizer]
    rules = {}
    if text.kind == "pretrained":
        config = ctx.source_config(text.source)
        rules = {
            "suppress": config.get("suppress_ids", ()),
            "suppress_begin": config.get("suppress_ids_begin", ()),
        }
    return Seq2SeqTask(model, modality, *decoding_args(cfg, ctx, modality), **rules)
