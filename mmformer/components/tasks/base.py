"""What every task kind's config shares: the model parts it names (``tokenizer_refs``,
``head_refs``: ``mmformer.registry.TaskParts``), what it reads from shards, and the rules shared by
the tasks that read captions or decode text."""

from __future__ import annotations

from typing import ClassVar

from ...errors import RecipeError, non_negative_weight, positive
from ..tokenizers import modality_at_load


class TaskConfigParts:
    """Defaults for a task config with one ``tokenizer`` and one ``head`` trained on its tokens.

    ``shards``: what the task reads from ``data.kind: shards`` — ``labelled`` (images or audio with a
    class), ``text`` (documents), ``captions`` (image– or audio–text pairs) or None (not read from shards).
    """

    shards: ClassVar[str | None] = None
    zero_shot: ClassVar[bool] = False  # reads zero-shot class prompts (data.label_key)

    def tokenizer_refs(self) -> dict[str, str]:
        return {"tokenizer": self.tokenizer}

    def head_refs(self) -> dict[str, tuple[str, str]]:
        return {"head": (self.head, self.tokenizer)}


class CaptionedTaskParts(TaskConfigParts):
    """A task reading inputs (``tokenizer``) and their captions (``caption_tokenizer``, text)."""

    shards: ClassVar[str | None] = "captions"
    # the captions run alone through a backbone (their tower, or the shared one): a contrastive task's
    # text side. Others pool their embeddings (diffusion), ignore them (vq), or join them to other
    # tokens in one sequence (prefix_lm, seq2seq, chameleon, transfusion)
    captions_alone: ClassVar[bool] = False

    def tokenizer_refs(self) -> dict[str, str]:
        return {"tokenizer": self.tokenizer, "caption_tokenizer": self.caption_tokenizer}


def check_captions(cfg, recipe, where: str) -> None:
    """A task's captions: read by a text tokenizer, no longer than its learned positions."""
    tok = recipe.model.tokenizers[cfg.caption_tokenizer]
    if modality_at_load(tok) not in ("text", None):
        raise RecipeError(f"'{where}.caption_tokenizer' {cfg.caption_tokenizer!r} must be a text tokenizer")
    bpe_len, data_len = getattr(tok, "max_len", None), getattr(cfg.data, "max_len", None)
    if bpe_len and data_len and data_len > bpe_len:
        raise RecipeError(
            f"'{where}.data': data.max_len={data_len} exceeds the caption tokenizer's learned positions "
            f"(max_len={bpe_len})"
        )


def decoding_args(cfg, ctx, modality: str) -> tuple:
    """What a text-decoding task (``prefix_lm``, ``seq2seq``) takes after its model and modality: the
    caption tokenizer, ``max_new_tokens`` (default ``data.max_len - 1``), beam size, length penalty, and
    the main metric with its direction (default ``wer`` for audio, else ``exact_match``)."""
    metric = cfg.main_metric or ("wer" if modality == "audio" else "exact_match")
    max_new = cfg.max_new_tokens or max(1, (getattr(cfg.data, "max_len", None) or 48) - 1)
    return (
        ctx.text_tokenizer(cfg.caption_tokenizer),
        max_new,
        cfg.beam_size,
        cfg.length_penalty,
        (metric, "max" if metric == "exact_match" else "min"),
    )


def check_decoding(cfg) -> None:
    """The value checks shared by the tasks that decode text (``prefix_lm``, ``seq2seq``)."""
    positive(cfg, "beam_size", "max_new_tokens")
    if cfg.main_metric not in (None, "wer", "cer", "exact_match"):
        raise ValueError(f"main_metric={cfg.main_metric!r}; choose wer, cer or exact_match")
    non_negative_weight(cfg)
