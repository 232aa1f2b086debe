"""Byte-level text tasks on the King James Bible, the Long Range Arena's "Text" and "Retrieval" (Tay et
al. 2021, arXiv:2011.04006 §3.2–3.3) rebuilt on text that installs offline (IMDb and the ACL Anthology
Network do not):

* ``kjv-books`` (Text): which of ``BOOKS`` a passage of 2,048–4,096 bytes comes from; 10 classes. Ten
  books across the genres (law, history, poetry, prophecy, gospel, epistle, apocalypse), each long
  enough (≥ 50 kB) to hold out whole chapters; a third of the 66 books have under 15 kB.
* ``kjv-pairs`` (Retrieval): do two passages of 1,024–2,047 bytes come from the same book? Stored as
  one sequence — passage A, the separator id 256, passage B (≤ 4,095 ids; meta.json's ``separator``) —
  and read as LRA reads its pairs, two towers (``data.pairs: true`` splits it at the separator; a
  ``pair_classifier`` head classifies [u, v, u·v, u−v]), or as one sequence whose halves attend to
  each other (``data.pairs: false``, a ``classifier`` head).

Bytes are the tokens (UTF-8, ids 0–255). Passages are runs of whole verses (verse numbers and chapter
headings removed — a heading names the book), joined by spaces. Each book's chapters are split once,
in contiguous blocks (seeded): about 10 % for validation, 10 % for test, the rest for training; every
passage lies inside one split's block, so no text is shared across splits (passages of one split may
overlap each other: they are windows at random verses). The same blocks serve both datasets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...progress import progress
from ..roots import DataError, resolve_root
from ..sequence_format import write_meta, write_split

BOOKS = (
    "Genesis",
    "Leviticus",
    "1 Samuel",
    "Job",
    "Psalms",
    "Isaiah",
    "Matthew",
    "Acts",
    "Romans",
    "Revelation",
)
SPLITS = ("train", "val", "test")
HELD_OUT = 0.1  # of each book's chapters, for validation and again for test (at least one chapter each)
SEPARATOR = 256  # kjv-pairs: the id between the two passages


def read_books(root: Path) -> dict[str, list[list[str]]]:
    """book → its chapters, each a list of verse texts (no numbers), from a prepared ``kjv`` folder."""
    path = root / "kjv.txt"
    books: dict[str, list[list[str]]] = {}
    for doc in path.read_text(encoding="utf-8").strip().split("\n\n"):
        heading, *verses = doc.split("\n")
        book = heading.rsplit(" ", 1)[0]  # "1 Samuel 3" → "1 Samuel"
        books.setdefault(book, []).append([v.split(" ", 1)[1] for v in verses])
    missing = [b for b in BOOKS if b not in books]
    if missing:
        raise DataError(f"{path} lacks the books {missing}")
    return books


def split_blocks(n_chapters: int, rng: np.random.Generator) -> dict[str, list[range]]:
    """split → its runs of consecutive chapter indices: one block each for val and test, at random
    places, and the rest (up to three runs) for train."""
    n = max(1, round(HELD_OUT * n_chapters))
    val = int(rng.integers(0, n_chapters - n + 1))
    starts = [s for s in range(n_chapters - n + 1) if s + n <= val or s >= val + n]
    test = int(starts[rng.integers(len(starts))])
    held = {"val": range(val, val + n), "test": range(test, test + n)}
    train, run = [], []
    for c in range(n_chapters):
        if any(c in r for r in held.values()):
            if run:
                train.append(range(run[0], run[-1] + 1))
            run = []
        else:
            run.append(c)
    if run:
        train.append(range(run[0], run[-1] + 1))
    return {"train": train, "val": [held["val"]], "test": [held["test"]]}


def book_runs(root: Path, seed: int) -> dict[str, dict[str, list[list[bytes]]]]:
    """book → split → runs of consecutive verses (UTF-8 bytes), each run one contiguous block of chapters."""
    books = read_books(root)
    out = {}
    for i, book in enumerate(BOOKS):
        chapters = books[book]
        blocks = split_blocks(len(chapters), np.random.default_rng([seed, i]))
        out[book] = {
            split: [[v.encode("utf-8") for c in run for v in chapters[c]] for run in runs]
            for split, runs in blocks.items()
        }
    return out


def passage(
    runs: list[list[bytes]], low: int, high: int, rng: np.random.Generator
) -> tuple[bytes, tuple[int, int, int]]:
    """A passage of ``low``–``high`` bytes (whole verses joined by spaces) at a random verse of a run
    (runs weighted by length), and where it is: (run, first verse, end verse)."""
    cumulative = np.cumsum([sum(len(v) + 1 for v in run) for run in runs])
    for _ in range(10_000):
        r = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
        run = runs[r]
        target = int(rng.integers(low, high + 1))
        start = int(rng.integers(len(run)))
        size, end = -1, start
        while end < len(run) and size + 1 + len(run[end]) <= target:
            size += 1 + len(run[end])
            end += 1
        if size >= low:
            return b" ".join(run[start:end]), (r, start, end)
    raise DataError(f"no passage of {low}-{high} bytes fits these verses")


def _kjv_root() -> Path:
    return resolve_root("kjv")  # the bundled KJV, prepared first when missing


def build_kjv_books(out: Path, per_class: dict[str, int] | None = None, seed: int = 0) -> None:
    """``kjv-books``: passages of 2,048–4,096 bytes → their book (``mmformer.data.sequences`` format;
    ``<split>-sample.jsonl`` shows the first 20 of each split as text with the book's name)."""
    import json

    per_class = per_class or {"train": 400, "val": 30, "test": 30}
    runs = book_runs(_kjv_root(), seed)
    rng = np.random.default_rng([seed, 1])
    for split in SPLITS:
        seqs, labels, rows = [], [], []
        for label, book in enumerate(progress(BOOKS, f"kjv-books: {split} passages", unit="book")):
            for _ in range(per_class[split]):
                text, _ = passage(runs[book][split], 2048, 4096, rng)
                seqs.append(np.frombuffer(text, dtype=np.uint8))
                labels.append(label)
                rows.append(json.dumps({"text": text.decode("utf-8"), "label": book}, ensure_ascii=False))
        order = rng.permutation(len(seqs))
        write_split(out, split, [seqs[i] for i in order], [labels[i] for i in order])
        (out / f"{split}-sample.jsonl").write_text(
            "\n".join(rows[i] for i in order[:20]) + "\n", encoding="utf-8"
        )
    write_meta(
        out,
        256,
        4096,
        list(BOOKS),
        {s: per_class[s] * len(BOOKS) for s in SPLITS},
        seed=seed,
        source="King James Bible (Debian bible-kjv): byte-level passages of 10 books",
    )
    (out / "README.md").write_text(
        "Byte-level book classification on the King James Bible (mmformer/data/lra/kjv.py), LRA's 'Text' "
        f"rebuilt offline: passages of 2,048-4,096 bytes (whole verses) from 10 books ({', '.join(BOOKS)}); "
        f"{per_class['train']} / {per_class['val']} / {per_class['test']} passages per book in train / val / "
        "test, drawn from disjoint contiguous blocks of each book's chapters (about 80/10/10 %). "
        "<split>-sample.jsonl shows the first 20 passages of each split as text.\n"
    )


def build_kjv_pairs(out: Path, pairs: dict[str, int] | None = None, seed: int = 0) -> None:
    """``kjv-pairs``: two passages of 1,024–2,047 bytes joined by ``SEPARATOR`` → 1 when they come from
    the same book, 0 otherwise (balanced; a negative's two books are a random pair of distinct books).
    ``<split>-sample.jsonl`` shows the first 20 pairs of each split as text with their books."""
    import json

    pairs = pairs or {"train": 4000, "val": 500, "test": 500}
    runs = book_runs(_kjv_root(), seed)
    rng = np.random.default_rng([seed, 2])
    for split in SPLITS:
        seqs, labels, books, rows = [], [], [], []
        drawn = rng.permutation(np.arange(pairs[split]) % 2)
        for label in progress(drawn, f"kjv-pairs: {split}", unit="pair"):
            a, b = (int(i) for i in rng.choice(len(BOOKS), size=2, replace=False))
            if label == 1:
                b = a
            text_a, where_a = passage(runs[BOOKS[a]][split], 1024, 2047, rng)
            while True:  # the two passages of a positive never overlap
                text_b, where_b = passage(runs[BOOKS[b]][split], 1024, 2047, rng)
                if a != b or where_a[0] != where_b[0] or where_a[2] <= where_b[1] or where_b[2] <= where_a[1]:
                    break
            seqs.append(
                np.concatenate(
                    [np.frombuffer(text_a, np.uint8), [SEPARATOR], np.frombuffer(text_b, np.uint8)]
                )
            )
            labels.append(int(label))
            books.append((a, b))
            if len(rows) < 20:
                texts = {"a": text_a.decode("utf-8"), "b": text_b.decode("utf-8")}
                rows.append(
                    json.dumps(
                        {**texts, "books": [BOOKS[a], BOOKS[b]], "label": ["different", "same"][int(label)]},
                        ensure_ascii=False,
                    )
                )
        write_split(out, split, seqs, labels)
        (out / f"{split}-sample.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
        np.save(out / f"{split}-books.npy", np.asarray(books, dtype=np.int64))
    write_meta(
        out,
        257,
        2 * 2047 + 1,
        ["different", "same"],
        dict(pairs),
        seed=seed,
        books=list(BOOKS),
        separator=SEPARATOR,
        source="King James Bible (Debian bible-kjv): byte-level passage pairs of 10 books",
    )
    (out / "README.md").write_text(
        "Byte-level passage matching on the King James Bible (mmformer/data/lra/kjv.py), LRA's 'Retrieval' "
        "rebuilt offline: two passages of 1,024-2,047 bytes joined by the separator id 256; class 1 (same) "
        f"when both come from the same one of {len(BOOKS)} books, 0 (different) otherwise; balanced; "
        f"{pairs['train']:,} / {pairs['val']:,} / {pairs['test']:,} pairs in train / val / test, from the "
        "same disjoint chapter blocks as kjv-books. <split>-books.npy holds each pair's two book indices "
        "(meta.json's books); <split>-sample.jsonl shows the first 20 pairs of each split as text. "
        "data.pairs: true reads each pair as its two passages (LRA's two towers).\n"
    )
