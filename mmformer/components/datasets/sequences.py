"""Dataset kind ``sequences``: integer token sequences with class labels (``mmformer.data.sequences``; the
format is ``mmformer.data.sequence_format``), read by an ``ids`` tokenizer — the Long Range Arena sets
``listops``, ``pathfinder``, ``kjv-books``, ``kjv-pairs``, ``mnist5k-pixels`` (docs/long_context.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...data.sequences import sequences_data
from ...errors import RecipeError, positive
from ...registry import register
from ..context import BuildContext
from .base import LoaderConfig, task_of


@dataclass
class SequencesDataConfig(LoaderConfig):
    """``tasks.<name>.data`` of kind ``sequences``: ``root/meta.json`` and ``root/<split>.npz``; ``root`` is
    a path or a bundled name (``listops``). Batches are padded to their longest sequence."""

    kind: str = "sequences"
    train_split: str = "train"
    val_split: str = "val"  # the bundled LRA sets also have "test"
    max_len: Optional[int] = None  # tokens per sequence, longer ones cut; default: meta.json's max_len
    limit_train: Optional[int] = None  # use N training sequences (a seeded choice)
    bucket_by_length: bool = False  # batches of sequences of similar length (less padding)

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "max_len", "limit_train")

    def check(self, recipe, where: str) -> None:
        task = task_of(recipe, where)
        tok = recipe.model.tokenizers[task.tokenizer]
        if tok.kind != "ids":
            raise RecipeError(
                f"'{where}': sequences data is read by an ids tokenizer; {task.tokenizer!r} is {tok.kind}"
            )
        if self.max_len and tok.max_len and self.max_len > tok.max_len:
            raise RecipeError(
                f"'{where}.max_len' is {self.max_len} but tokenizer {task.tokenizer!r} has learned positions "
                f"up to max_len={tok.max_len}"
            )


@register("dataset", "sequences", SequencesDataConfig)
def build_sequences(cfg: SequencesDataConfig, task, ctx: BuildContext):
    tok = ctx.recipe.model.tokenizers[task.tokenizer]
    return sequences_data(cfg, tok.vocab_size, tok.max_len, ctx.num_classes(task), ctx.recipe.seed)
