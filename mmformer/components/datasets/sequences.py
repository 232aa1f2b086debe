"""Dataset kind ``sequences``: integer token sequences with class labels (``mmformer.data.sequences``; the
format is ``mmformer.data.sequence_format``), read by an ``ids`` tokenizer — the Long Range Arena sets
``listops``, ``pathfinder``, ``kjv-books``, ``kjv-pairs``, ``mnist5k-pixels`` (docs/long_context.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...data.prepare import BUNDLED
from ...data.sequences import sequences_data
from ...errors import RecipeError, positive
from ...nn.kernels import position_biases
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
    # each sequence is two joined by meta.json's separator id (kjv-pairs): read as pairs, 2B rows per
    # batch of B, for a pair_classifier head (two towers); max_len then cuts each half
    pairs: bool = False

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
        bundled = BUNDLED.get(str(self.root))
        if self.pairs and bundled is not None and not bundled.pairs:  # said before preparing it
            sets = ", ".join(n for n, b in BUNDLED.items() if b.pairs)
            raise RecipeError(
                f"'{where}.pairs' is true but the bundled set {self.root!r} holds single sequences, not pairs "
                f"(bundled pair sets: {sets})"
            )
        name = getattr(task, "head", None)
        head = recipe.model.heads.get(name)
        kind = getattr(head, "kind", None)
        if self.pairs and kind != "pair_classifier":
            raise RecipeError(
                f"'{where}.pairs' is true but head {name!r} is {kind!r}: pairs (2B rows per batch of B) are "
                f"read by a two-tower head — set model.heads.{name}.kind: pair_classifier, or {where}.pairs: false"
            )
        fits = id_positions(tok)
        if self.max_len and fits and self.max_len > fits:
            raise RecipeError(
                f"'{where}.max_len' is {self.max_len} but tokenizer {task.tokenizer!r} has learned positions "
                f"for {fits} ids (max_len={tok.max_len}{', one for its class token' if tok.class_token else ''})"
            )


def id_positions(tok) -> Optional[int]:
    """Ids that an ``ids`` tokenizer has learned positions for: ``max_len``, less one for a class token."""
    return tok.max_len - int(tok.class_token) if tok.max_len else None


def id_limit(tok, backbone) -> tuple[Optional[int], str]:
    """The most ids one sequence may hold for ``tok`` and ``backbone`` (None: no limit), and why: the
    tokenizer's learned positions, or an AFT kernel's position biases (``kernel_options.max_len``), each
    less one for a class token."""
    limits = []
    if (fits := id_positions(tok)) is not None:
        why = f"max_len={tok.max_len} less one for its class token" if tok.class_token else "its max_len"
        limits.append((fits, f"the ids tokenizer has learned positions for {fits} ids ({why})"))
    kernel = getattr(backbone, "attn_kernel", None)
    biases = position_biases(kernel, dict(backbone.kernel_options)) if kernel else None
    if biases:
        fits = biases - int(tok.class_token)
        one = ", one of them the class token's" if tok.class_token else ""
        limits.append(
            (
                fits,
                f"the {kernel} kernel holds position biases for {biases} tokens{one} "
                "(model.backbone.kernel_options.max_len)",
            )
        )
    return min(limits) if limits else (None, "")


@register("dataset", "sequences", SequencesDataConfig)
def build_sequences(cfg: SequencesDataConfig, task, ctx: BuildContext):
    tok = ctx.recipe.model.tokenizers[task.tokenizer]
    limit, why = id_limit(tok, ctx.recipe.model.backbone)
    return sequences_data(cfg, tok.vocab_size, limit, ctx.num_classes(task), ctx.recipe.seed, why)
