"""ListOps (Nangia & Bowman 2018, arXiv:1804.06028) as the Long Range Arena generates it (Tay et al. 2021,
arXiv:2011.04006 §3.1; google-research/long-range-arena ``lra_benchmarks/data/listops.py``): nested
operations on the digits 0–9 — ``[MAX``, ``[MIN``, ``[MED`` (the median, rounded down), ``[SM`` (the sum
modulo 10) — whose value 0–9 is the class::

    [MAX 2 9 [MIN 4 7 ] 0 ]   →  9

The generator is LRA's: a node at depth < 10 is an operator with probability 0.25 (else a digit; depth 10
is always a digit), an operator has 2–10 arguments, the operator is drawn after its arguments; only
trees of strictly between 500 and 2,000 tokens are kept, each distinct tree once. Tokens are the
operators, the digits and ``]`` — LRA's ``length`` — so every sequence has 501–1,999 tokens.

One difference from LRA's released pipeline: its tokenizer (``tfds`` ``Tokenizer``, alphanumeric only)
drops every ``]``, which makes an expression ambiguous (where does an operator's argument list end?);
here ``]`` is a token, as in Nangia & Bowman.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...progress import progress
from ..sequence_format import write_meta, write_split

DIGITS = [str(d) for d in range(10)]
OPERATORS = ["[MIN", "[MAX", "[MED", "[SM"]
END = "]"
VOCABULARY = [*DIGITS, *OPERATORS, END]  # id → token: 0–9 are the digits, 10–13 the operators, 14 is "]"
MIN_ID, MAX_ID, MED_ID, SM_ID, END_ID = 10, 11, 12, 13, 14
VALUE_P = 0.25  # LRA: P(a node above the deepest level is a digit) = 1 - VALUE_P
MAX_DEPTH, MAX_ARGS = 10, 10
MIN_LENGTH, MAX_LENGTH = 500, 2000  # kept: MIN_LENGTH < tokens < MAX_LENGTH


class _TooLong(Exception):
    pass


def _grow(rng: random.Random, depth: int, out: list[int]) -> None:
    """Append one subtree's tokens to ``out`` (LRA's ``generate_tree``: arguments, then the operator).
    Stops early with ``_TooLong`` once the tree cannot be kept: the same kept trees, drawn faster."""
    if (rng.random() if depth < MAX_DEPTH else 1.0) > VALUE_P:
        out.append(rng.randrange(10))
    else:
        n_args = rng.randint(2, MAX_ARGS)
        at = len(out)
        out.append(-1)  # the operator, drawn after its arguments as LRA draws it
        for _ in range(n_args):
            _grow(rng, depth + 1, out)
        out[at] = MIN_ID + rng.randrange(len(OPERATORS))
        out.append(END_ID)
    if len(out) >= MAX_LENGTH:
        raise _TooLong


def generate(n: int, seed: int) -> list[bytes]:
    """``n`` distinct expressions (token ids, one byte each), in the order drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    kept: dict[bytes, None] = {}
    with progress(desc="listops: drawing expressions", total=n, unit="expr") as bar:
        while len(kept) < n:
            out: list[int] = []
            try:
                _grow(rng, 1, out)
            except _TooLong:
                continue
            if len(out) > MIN_LENGTH and bytes(out) not in kept:
                kept[bytes(out)] = None
                bar.update()
    return list(kept)


def evaluate(ids: Sequence[int]) -> int:
    """The value of an expression (LRA's ``to_value``)."""
    stack: list[list[int]] = [[]]
    for t in ids:
        if t < 10:
            stack[-1].append(t)
        elif t == END_ID:
            op, *args = stack.pop()
            if op == MIN_ID:
                v = min(args)
            elif op == MAX_ID:
                v = max(args)
            elif op == MED_ID:  # int(np.median(args)) as LRA: the mean of the middle two, rounded down
                ordered = sorted(args)
                v = (ordered[(len(args) - 1) // 2] + ordered[len(args) // 2]) // 2
            else:
                v = sum(args) % 10
            stack[-1].append(v)
        else:
            stack.append([t])
    (value,) = stack[0]
    return value


def to_text(ids: Sequence[int]) -> str:
    return " ".join(VOCABULARY[t] for t in ids)


def build_listops(
    out: Path, n_train: int = 5_000, n_val: int = 500, n_test: int = 500, seed: int = 0
) -> None:
    """``train`` / ``val`` / ``test`` splits (``mmformer.data.sequences`` format) of distinct expressions;
    a sample of each split as text in ``<split>-sample.tsv`` (expression, value)."""
    seqs = generate(n_train + n_val + n_test, seed)
    labels = [evaluate(s) for s in seqs]
    cuts = {"train": (0, n_train), "val": (n_train, n_train + n_val), "test": (n_train + n_val, len(seqs))}
    for split, (a, b) in cuts.items():
        write_split(out, split, [np.frombuffer(x, dtype=np.uint8) for x in seqs[a:b]], labels[a:b])
        rows = [f"{to_text(s)}\t{v}" for s, v in zip(seqs[a : a + 20], labels[a : a + 20])]
        (out / f"{split}-sample.tsv").write_text("Source\tTarget\n" + "\n".join(rows) + "\n")
    splits = {k: b - a for k, (a, b) in cuts.items()}
    write_meta(
        out,
        len(VOCABULARY),
        MAX_LENGTH - 1,
        DIGITS,
        splits,
        vocabulary=VOCABULARY,
        seed=seed,
        source="generated: LRA's ListOps grammar (max depth 10, 2–10 arguments, 500 < tokens < 2,000)",
    )
    (out / "README.md").write_text(
        "ListOps as the Long Range Arena generates it (mmformer/data/lra/listops.py): expressions of "
        "[MAX, [MIN, [MED, [SM (sum mod 10) over the digits 0-9, depth <= 10, 2-10 arguments, "
        f"501-1,999 tokens; class = the value. Python random seed {seed}; "
        f"{splits['train']:,} train / {splits['val']:,} val / {splits['test']:,} test "
        "(LRA: 96,000 / 2,000 / 2,000: `mmformer data prepare listops-full`). "
        "Unlike LRA's released tokenizer, ']' is kept as a token.\n"
    )
