"""Dataset kind ``shards``: WebDataset tar shards written by ``mmformer data shard`` (``mmformer.data.shards``,
``packed_shards``, ``caption_shards``). What a task reads from them is declared by its config's ``shards``
(``labelled`` images or audio, ``text`` documents, ``captions``), so a new task kind needs no edit here."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from ...data.audio import collate_audio
from ...data.audio_caption import collate_audio_captions
from ...data.caption_shards import audio_caption_decoder, image_caption_decoder
from ...data.collate import collate_classification
from ...data.image import image_preprocess
from ...data.image_caption import collate_captions, read_class_prompts
from ...data.packed_shards import collate_text, packed_text_stream
from ...data.roots import resolve_root
from ...data.shard_sources import shards_data, split_parts
from ...data.shards import audio_decoder, image_decoder, text_decoder
from ...errors import RecipeError, positive
from ...registry import kinds, lookup, register
from ...tokenizers.image import ImagePreprocess
from ..backbones import require_position_biases
from ..context import BuildContext
from ..tokenizers import audio_preprocess, modality_at_load
from .base import task_of
from .captions import require_caption_biases


def shard_reader(recipe, where: str, what: str):
    """The task config that reads the data at ``where``; raises ``RecipeError`` naming the task kinds
    that read shard-style samples when it does not (``what``: the data kind, as the message names it)."""
    task = task_of(recipe, where)
    if task.shards is None:
        readers = ", ".join(k for k in kinds("task") if lookup("task", k).config.shards)
        raise RecipeError(f"'{where}': {what} is not read by a {task.kind} task ({readers} read it)")
    return task


def require_sample_biases(recipe, task, cfg, where: str) -> None:
    """AFT's position biases against the tokens of shard-style samples (``shards``, ``hf_dataset``):
    documents of ``seq_len`` tokens (or packed windows), captions of ``max_len``."""
    if task.shards == "text":
        require_position_biases(recipe, task.tokenizer, cfg.seq_len, f"'{where}.seq_len'")
    if task.shards == "captions":
        require_caption_biases(recipe, task, cfg.max_len, where)


@dataclass
class ShardsDataConfig:
    """``tasks.<name>.data`` of kind ``shards``: WebDataset tar shards — written by ``mmformer data shard``
    (with ``index.json``) or by anyone else (counted once, ``mmformer.data.shard_sources``) — read per
    rank and per data-loader worker through a shuffling buffer (``mmformer.data.shards``):
    images or audio with class labels (classification); documents (causal_lm, masked_lm: one padded
    document per sample, or with ``pack`` full windows as ``data.kind: text``, ``packed_shards``);
    image–caption or audio–transcript pairs (contrastive, prefix_lm, seq2seq: the items and batches of
    ``data.kind: image_caption`` / ``audio_caption``, ``caption_shards``; the caption tokenizer needs a
    ``path``). ``val_split`` is the split's name in the index: ``test`` for shards of ``asterisk-speech``.

    ``root`` / ``val_root``: a shard folder, a bundled name, shard paths or URLs (``pipe:``, ``file:``,
    ``http(s):``) with braces ``{000000..000009}`` and globs, several joined by ``::`` (OpenCLIP's
    ``--train-data``); ``upsampling_factors``: one per ``::`` source, mixes them (OpenCLIP's
    ``--train-data-upsampling-factors``; see ``mmformer.data.shard_sources``)."""

    kind: str = "shards"
    root: str = MISSING
    val_root: Optional[str] = None  # evaluation shards, when root holds training shards only (--val-data)
    upsampling_factors: Optional[list[float]] = None  # one per '::' source of root
    train_split: str = "train"
    val_split: str = "val"
    batch_size: int = 64
    val_batch_size: Optional[int] = None
    num_workers: int = 2
    shuffle_buffer: int = 1000  # samples held for shuffling, per worker
    seq_len: int = 256  # text: tokens per document (truncated, padded) or per packed window
    pack: bool = False  # text: pack documents into full seq_len windows with document ids (training)
    max_len: int = 32  # captions: tokens, BOS/EOS included, longer ones cut (audio_caption's default is 48)
    label_key: Optional[str] = None  # image captions: the row field naming each item's zero-shot class,
    # with its prompts in <root>/<label_key>.json (copied there by `mmformer data shard`)
    crop_padding: int = 0  # image classification training augmentation
    hflip: bool = False

    def __post_init__(self) -> None:
        positive(self, "batch_size", "val_batch_size", "shuffle_buffer", "seq_len", "max_len")
        if self.upsampling_factors is not None and self.root is not MISSING and self.root != "???":
            n = len(split_parts(self.root))
            if len(self.upsampling_factors) != n:
                raise ValueError(
                    f"upsampling_factors has {len(self.upsampling_factors)} values for {n} '::' source(s) "
                    f"of root {self.root!r}"
                )
            if any(f < 0 for f in self.upsampling_factors) or not any(self.upsampling_factors):
                raise ValueError(f"upsampling_factors must be >= 0, not all 0: {self.upsampling_factors}")
        if self.num_workers < 0 or self.crop_padding < 0:
            raise ValueError("num_workers and crop_padding must be >= 0")

    def check(self, recipe, where: str) -> None:
        task = shard_reader(recipe, where, "data.kind: shards")
        if self.pack and task.shards != "text":
            raise RecipeError(
                f"'{where}.pack' packs text shards for causal_lm / masked_lm, not a {task.kind} task: remove it"
            )
        require_sample_biases(recipe, task, self, where)
        if self.label_key and not task.zero_shot:
            raise RecipeError(
                f"'{where}.label_key' (zero-shot classes) applies to image_caption shards of a contrastive task"
            )
        if task.shards == "labelled" and modality_at_load(recipe.model.tokenizers[task.tokenizer]) == "text":
            raise RecipeError(f"'{where}': classification shards hold images or audio, not text")
        if self.label_key and modality_at_load(recipe.model.tokenizers[task.tokenizer]) not in (
            "image",
            None,
        ):
            raise RecipeError(f"'{where}.label_key' (zero-shot classes) applies to image_caption shards")


@register("dataset", "shards", ShardsDataConfig)
def build_shards(cfg: ShardsDataConfig, task, ctx: BuildContext):
    decoders, packed = shard_decoders(cfg, task, ctx)
    num_classes = ctx.num_classes(task) if task.shards == "labelled" else None
    return shards_data(cfg, task.kind, decoders, ctx.recipe.seed, num_classes, packed)


def shard_decoders(cfg, task, ctx: BuildContext) -> tuple[dict, Callable | None]:
    """``({what the samples hold: (train decode, val decode, collate)}, packed)`` for this task's
    tokenizer: the WebDataset-sample decoders (``image`` / ``audio`` with ``cls``, ``text``,
    ``image_caption`` / ``audio_caption``), shared by every data kind that yields such samples
    (``shards``, ``hf_dataset``); ``packed`` builds packed text windows (``cfg.pack``), else None."""
    tok = ctx.recipe.model.tokenizers[task.tokenizer]
    modality = ctx.tokenizer_modality(tok)
    packed = None
    if task.shards == "labelled" and modality == "image":
        train, val = image_preprocess(cfg, ctx.image_spec(tok))
        decoders = {"image": (image_decoder(train), image_decoder(val), collate_classification)}
    elif task.shards == "labelled" and modality == "audio":
        train, val = audio_preprocess(tok)
        decoders = {"audio": (audio_decoder(train), audio_decoder(val), collate_audio)}
    elif task.shards == "text":
        text_tok = ctx.text_tokenizer(task.tokenizer)
        text = text_decoder(text_tok, cfg.seq_len)
        decoders = {"text": (text, text, collate_text)}
        if cfg.pack:
            packed = functools.partial(packed_text_stream, tokenizer=text_tok, seq_len=cfg.seq_len)
    elif task.shards == "captions":
        decoders = _caption_decoders(cfg, task, ctx)
    else:
        raise RecipeError(f"data.kind: {cfg.kind}: a {task.kind} task does not read {modality} samples")
    return decoders, packed


def _caption_decoders(cfg: ShardsDataConfig, task, ctx: BuildContext) -> dict:
    """``{modality: (train decode, val decode, collate)}`` of the caption shards this task reads: the
    items and batches of ``image_caption`` / ``audio_caption`` data."""
    tok = ctx.recipe.model.tokenizers[task.tokenizer]
    captions = ctx.text_tokenizer(task.caption_tokenizer)
    modality = ctx.tokenizer_modality(tok)
    if modality == "image":
        spec = ctx.image_spec(tok)
        classes = None
        if cfg.label_key:
            prompts = read_class_prompts(resolve_root(cfg.root), cfg.label_key)
            classes = {c: i for i, c in enumerate(prompts)}
        decode = image_caption_decoder(
            ImagePreprocess(spec.image_size, spec.in_chans), captions, cfg.max_len, cfg.label_key, classes
        )
        collate = functools.partial(collate_captions, pad_id=captions.pad_id)
        return {"image_caption": (decode, decode, collate)}
    if modality == "audio":
        train, val = audio_preprocess(tok)
        collate = functools.partial(collate_audio_captions, pad_id=captions.pad_id)
        return {
            "audio_caption": (
                audio_caption_decoder(train, captions, cfg.max_len),
                audio_caption_decoder(val, captions, cfg.max_len),
                collate,
            )
        }
    raise RecipeError(
        f"caption shards pair images or audio with text; tokenizer {task.tokenizer!r} reads text"
    )
