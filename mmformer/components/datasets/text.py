"""Dataset kinds of text: ``text`` (a corpus of blank-line separated documents, ``mmformer.data.text``)
and ``text_classification`` (JSONL manifests of texts and labels, ``mmformer.data.text_classification``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...data.text import text_data
from ...data.text_classification import text_classification_data
from ...errors import positive
from ...registry import register
from ..backbones import require_position_biases
from ..context import BuildContext
from .base import LoaderConfig


@dataclass
class TextDataConfig(LoaderConfig):
    """``tasks.<name>.data`` of kind ``text``: a corpus (file or folder, blank-line separated documents),
    a path or a bundled name (``kjv``); tokenized once into a memory-mapped cache."""

    kind: str = "text"
    seq_len: int = 256
    pack: bool = True  # pack documents into full windows (with document ids) instead of padding each
    val_fraction: float = 0.05  # documents held out, seeded by the recipe seed
    # pack: false — batches of documents of similar length, trimmed to their longest (less padding)
    bucket_by_length: bool = False

    def __post_init__(self) -> None:
        if self.bucket_by_length and self.pack:
            raise ValueError("bucket_by_length needs pack: false (packed windows all have seq_len tokens)")
        super().__post_init__()
        positive(self, "seq_len")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")

    def check(self, recipe, where: str) -> None:
        """Refuses an AFT kernel with position biases for fewer than ``seq_len`` tokens."""
        task = recipe.tasks[where.split(".")[1]]
        require_position_biases(recipe, task.tokenizer, self.seq_len, f"'{where}.seq_len'")


@dataclass
class TextClassificationDataConfig(LoaderConfig):
    """``tasks.<name>.data`` of kind ``text_classification``: JSONL manifests ``root/train.jsonl`` and
    ``root/val.jsonl`` of ``{"text": …, "label": …}`` (label a class name); ``root/classes.txt``, when
    present, fixes the class order. ``root`` is a path or a bundled name (``wordnet-supersenses``)."""

    kind: str = "text_classification"
    max_len: int = 128  # tokens per text, special tokens included; longer texts are cut
    limit_train: Optional[int] = None  # use the first N training examples (after a seeded shuffle)

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "max_len", "limit_train")


@register("dataset", "text", TextDataConfig)
def build_text_data(cfg: TextDataConfig, task, ctx: BuildContext):
    return text_data(cfg, ctx.text_tokenizer(task.tokenizer), ctx.recipe.seed)


@register("dataset", "text_classification", TextClassificationDataConfig)
def build_text_classification_data(cfg: TextClassificationDataConfig, task, ctx: BuildContext):
    return text_classification_data(
        cfg, ctx.text_tokenizer(task.tokenizer), ctx.num_classes(task), ctx.recipe.seed
    )
