"""Text corpora: documents, seeded split, one-time tokenization into a memory-mapped cache, packing
with document ids, padding; the real KJV preparation when its Debian package is present."""

import shutil

import numpy as np
import pytest
import torch

from mmformer.data.roots import DataError
from mmformer.data.text import PackedText, PaddedText, TokenCache, read_documents, split_documents
from mmformer.tokenizers import TextTokenizer

DOCS = [
    "Genesis 1\n1 In the beginning God created the heaven and the earth.",
    "Genesis 2\n1 Thus the heavens and the earth were finished.",
    "Exodus 1\n1 Now these are the names of the children of Israel.",
    "Exodus 2\n1 And there went a man of the house of Levi.",
]


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer.train(DOCS * 5, vocab_size=320, min_frequency=1)


def test_read_documents_from_file_and_folder(tmp_path):
    (tmp_path / "c.txt").write_text("\n\n".join(DOCS) + "\n")
    assert read_documents(tmp_path / "c.txt") == DOCS
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, d in enumerate(DOCS):
        (folder / f"{i}.txt").write_text(d)
    assert read_documents(folder) == DOCS
    (tmp_path / "empty.txt").write_text("\n\n\n")
    with pytest.raises(DataError, match="no text"):
        read_documents(tmp_path / "empty.txt")


def test_split_is_seeded_disjoint_and_complete():
    train, val = split_documents(100, 0.1, seed=3)
    assert len(val) == 10 and len(train) == 90 and not set(train) & set(val)
    assert set(train) | set(val) == set(range(100))
    again, _ = split_documents(100, 0.1, seed=3)
    other, _ = split_documents(100, 0.1, seed=4)
    assert np.array_equal(train, again) and not np.array_equal(train, other)


def test_token_cache_is_built_once_and_exact(tok, tmp_path):
    first = TokenCache(DOCS, tok, tmp_path)
    assert first.created and first.tokens.dtype == np.uint32
    for i, d in enumerate(DOCS):
        assert first.document(i).tolist() == tok.encode(d)
    second = TokenCache(DOCS, tok, tmp_path)
    assert not second.created and np.array_equal(second.offsets, first.offsets)
    changed = TokenCache(DOCS[:2], tok, tmp_path)
    assert changed.created  # different corpus, different cache entry


def test_packing_keeps_documents_apart(tok, tmp_path):
    cache = TokenCache(DOCS, tok, tmp_path)
    ds = PackedText(cache, np.arange(4), seq_len=8, eos_id=tok.eos_id)
    stream = np.concatenate([np.append(cache.document(i), tok.eos_id) for i in range(4)])
    assert len(ds) == len(stream) // 8
    for i in range(len(ds)):
        item = ds[i]
        assert item["text"].tolist() == stream[i * 8 : (i + 1) * 8].tolist()
        assert item["text_valid"].all() and item["text_document"][0] == 0
        # a new document id starts right after each eos
        eos = (item["text"] == tok.eos_id).nonzero().flatten().tolist()
        for p in eos:
            if p + 1 < 8:
                assert item["text_document"][p + 1] == item["text_document"][p] + 1
    with pytest.raises(DataError, match="cannot fill one window"):
        PackedText(cache, np.arange(1), seq_len=10_000, eos_id=tok.eos_id)


def test_padding_marks_pad_as_invalid(tok, tmp_path):
    cache = TokenCache(DOCS, tok, tmp_path)
    item = PaddedText(
        cache, np.arange(4), seq_len=64, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id
    )[0]
    n = len(tok.encode(DOCS[0])) + 2
    assert item["text"][0] == tok.bos_id and item["text"][n - 1] == tok.eos_id
    assert item["text_valid"].sum() == n and (item["text"][n:] == tok.pad_id).all()
    assert tok.pad_id != tok.eos_id
    short = PaddedText(
        cache, np.arange(4), seq_len=4, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id
    )[0]
    assert short["text_valid"].all() and short["text"].shape == (4,)
    assert torch.equal(short["text"][:1], torch.tensor([tok.bos_id]))


@pytest.mark.skipif(shutil.which("bible") is None, reason="Debian's bible-kjv is not installed")
def test_kjv_prepare_is_the_real_bible(tmp_path, monkeypatch):
    from mmformer.data.prepare import prepare

    monkeypatch.setenv("MMFORMER_DATA", str(tmp_path))
    docs = read_documents(prepare("kjv"))  # the folder: README.md is not a .txt corpus file
    assert len(docs) == 1189 and docs[0].startswith("Genesis 1\n1 In the beginning God created")
    assert docs[-1].startswith("Revelation 22\n") and sum(d.count("\n") for d in docs) == 31102
