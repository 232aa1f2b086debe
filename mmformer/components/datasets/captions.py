"""Dataset kinds of captioned media: ``image_caption`` and ``audio_caption`` — JSONL manifests pairing
an image or a clip with its text, read with the task's ``caption_tokenizer``
(``mmformer.data.image_caption``, ``mmformer.data.audio_caption``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...data.audio_caption import audio_caption_data
from ...data.image_caption import image_caption_data
from ...errors import RecipeError, positive
from ...registry import register
from ..backbones import require_position_biases
from ..context import BuildContext
from ..tokenizers import audio_preprocess, modality_at_load
from .base import LoaderConfig, task_of


@dataclass
class ImageCaptionDataConfig(LoaderConfig):
    """``tasks.<name>.data`` of kind ``image_caption``: ``root/<split>.jsonl`` of ``{"image": path,
    "caption": text}`` (paths relative to ``root``); ``root`` is a path or a bundled name (``emoji``).
    The captions are read with the task's ``caption_tokenizer``."""

    kind: str = "image_caption"
    train_split: str = "train"
    val_split: str = "val"
    max_len: int = 32  # caption tokens, BOS/EOS included; longer captions are cut
    batch_size: int = 64
    cache: bool = True  # keep decoded images in memory
    label_key: Optional[str] = None  # a row field naming each item's class (emoji: group), for zero-shot;
    # the classes and their prompts are read from root/<label_key>.json ({class: [prompt, …]})

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "max_len")

    def check(self, recipe, where: str) -> None:
        task = task_of(recipe, where)
        if getattr(task, "caption_tokenizer", None) is None:
            raise RecipeError(
                f"'{where}': image_caption data is read by a task with a caption_tokenizer (kind: diffusion, "
                "contrastive, prefix_lm or seq2seq)"
            )
        require_caption_biases(recipe, task, self.max_len, where)


@dataclass
class AudioCaptionDataConfig(LoaderConfig):
    """``tasks.<name>.data`` of kind ``audio_caption``: JSONL manifests ``root/<split>.jsonl`` of
    ``{"audio": path, "text": transcript}``; ``root`` is a path or a bundled name (``asterisk-speech``).
    The transcripts are read with the task's ``caption_tokenizer``."""

    kind: str = "audio_caption"
    train_split: str = "train"
    val_split: str = "test"
    text_key: str = "text"
    max_len: int = 48  # transcript tokens, BOS/EOS included; longer ones are cut
    synthetic: bool = True  # false: leave out the rows marked "synthetic": true (train on real clips only)

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "max_len")

    def check(self, recipe, where: str) -> None:
        task = task_of(recipe, where)
        if getattr(task, "caption_tokenizer", None) is None:
            raise RecipeError(
                f"'{where}': audio_caption data is read by a task with a caption_tokenizer (kind: contrastive, "
                "prefix_lm or seq2seq)"
            )
        if modality_at_load(recipe.model.tokenizers[task.tokenizer]) not in ("audio", None):
            raise RecipeError(
                f"'{where}': audio_caption data needs an audio tokenizer; {task.tokenizer!r} is not one"
            )
        require_caption_biases(recipe, task, self.max_len, where)


def require_caption_biases(recipe, task, max_len: int, where: str) -> None:
    """Refuses an AFT kernel (``kernel_options.max_len``) with position biases for fewer than the
    ``max_len`` caption tokens of ``where`` in the backbone that reads a task's captions alone (a
    contrastive task's text side: ``captions_alone``). A text-conditional DiT pools the captions'
    embeddings and a VQ task ignores them (no backbone reads them); the tasks that join captions to other
    tokens in one sequence (prefix-LM spans, seq2seq cross-attention, KV-cache decoding) are refused AFT
    by their mask rules."""
    if getattr(task, "captions_alone", False):
        require_position_biases(recipe, task.caption_tokenizer, max_len, f"'{where}.max_len'")


@register("dataset", "image_caption", ImageCaptionDataConfig)
def build_image_caption(cfg: ImageCaptionDataConfig, task, ctx: BuildContext):
    tokenizer = ctx.recipe.model.tokenizers[task.tokenizer]
    return image_caption_data(cfg, tokenizer, ctx.text_tokenizer(task.caption_tokenizer))


@register("dataset", "audio_caption", AudioCaptionDataConfig)
def build_audio_caption(cfg: AudioCaptionDataConfig, task, ctx: BuildContext):
    tok = ctx.recipe.model.tokenizers[task.tokenizer]
    if ctx.tokenizer_modality(tok) != "audio":
        raise RecipeError(f"audio_caption data needs an audio tokenizer; {task.tokenizer!r} is not one")
    return audio_caption_data(cfg, audio_preprocess(tok), ctx.text_tokenizer(task.caption_tokenizer))
