"""JSONL text-classification data and the WordNet supersense preparation, on tiny fixtures."""

import json

import pytest
import torch

from mmformer.data.prepare import LEXNAMES, build_wordnet_supersenses
from mmformer.data.roots import DataError
from mmformer.data.text_classification import collate_texts, read_manifest, text_classification_data
from mmformer.tokenizers.text import TextTokenizer


class Cfg:
    root, max_len, batch_size, val_batch_size, num_workers, drop_last, limit_train = (
        None,
        6,
        2,
        None,
        0,
        False,
        None,
    )


@pytest.fixture
def tokenizer():
    return TextTokenizer.train(["a cat and a dog", "the red car"] * 20, vocab_size=300)


def _write(root, split, rows):
    (root / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_manifests_become_padded_batches(tmp_path, tokenizer):
    _write(
        tmp_path,
        "train",
        [{"text": "a cat", "label": "animal"}, {"text": "the red car and a dog", "label": "thing"}],
    )
    _write(tmp_path, "val", [{"text": "a dog", "label": "animal"}])
    cfg = Cfg()
    cfg.root = str(tmp_path)
    data = text_classification_data(cfg, tokenizer, num_classes=2, seed=0)
    items = [data.train[i] for i in range(2)]
    assert items[0]["ids"] == [tokenizer.bos_id, *tokenizer.encode("a cat"), tokenizer.eos_id]
    assert len(items[1]["ids"]) == 6 and items[1]["ids"][-1] == tokenizer.eos_id  # cut, eos kept
    batch = data.collate(items)
    assert batch["text"].shape == (2, 6) and batch["label"].tolist() == [0, 1]  # sorted class names
    assert batch["text_valid"].sum(1).tolist() == [len(items[0]["ids"]), 6]
    assert (batch["text"][0, ~batch["text_valid"][0]] == tokenizer.pad_id).all()


def test_bad_manifest_line_names_file_and_line(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "ok", "label": "a"}\n{"txt": "typo", "label": "b"}\n')
    with pytest.raises(DataError, match=r"train.jsonl:2"):
        read_manifest(tmp_path / "train.jsonl")


def test_wrong_head_size_and_unknown_labels_are_refused(tmp_path, tokenizer):
    _write(tmp_path, "train", [{"text": "a cat", "label": "animal"}, {"text": "a car", "label": "thing"}])
    _write(tmp_path, "val", [{"text": "a dog", "label": "plant"}])
    cfg = Cfg()
    cfg.root = str(tmp_path)
    with pytest.raises(DataError, match="num_classes=3"):
        text_classification_data(cfg, tokenizer, num_classes=3, seed=0)
    with pytest.raises(DataError, match="plant"):
        text_classification_data(cfg, tokenizer, num_classes=2, seed=0)


def test_collate_pads_to_the_longest_text():
    batch = collate_texts([{"ids": [5, 6, 7], "label": 1}, {"ids": [5], "label": 0}], pad_id=9)
    assert batch["text"].tolist() == [[5, 6, 7], [5, 9, 9]]
    assert torch.equal(batch["text_valid"], torch.tensor([[True, True, True], [True, False, False]]))


def test_wordnet_supersenses_from_the_wordnet_file_format(tmp_path):
    src, out = tmp_path / "wn", tmp_path / "out"
    src.mkdir(), out.mkdir()
    header = "  1 This software and database is being provided to you, the LICENSEE, by  \n"
    (src / "data.noun").write_text(
        header
        + '01318894 05 n 01 cat 0 000 | feline mammal usually having thick soft fur; "cats purr"  \n'
        + "07705931 13 n 01 bread 0 000 | food made from dough of flour or meal  \n"
    )
    (src / "data.verb").write_text(
        header + "01835496 38 v 01 run 0 000 | move fast by using one's feet; \"Don't run!\"  \n"
    )
    for pos in ("adj", "adv"):
        (src / f"data.{pos}").write_text(header)
    build_wordnet_supersenses(out, source=src, val_percent=0)
    rows = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    assert [(r["text"], r["label"], r["lemma"]) for r in rows] == [
        ("feline mammal usually having thick soft fur", "noun.animal", "cat"),  # examples dropped
        ("food made from dough of flour or meal", "noun.food", "bread"),
        ("move fast by using one's feet", "verb.motion", "run"),
    ]
    assert (out / "classes.txt").read_text().split() == LEXNAMES and len(LEXNAMES) == 45


def test_fortunes_are_curated_into_one_document_per_quip(tmp_path):
    from mmformer.data.prepare import build_fortunes
    from mmformer.data.text import read_documents

    src, out = tmp_path / "fortunes", tmp_path / "out"
    src.mkdir(), out.mkdir()
    (src / "wisdom").write_text(
        "A quip that has\n\na blank line inside it.\n%\n|\\_/|  /\\ /\\\n| o |  -=#=-  ##\n%\nshort\n%\n"
        "He who laughs last thinks slowest.\n"
    )
    (src / "wisdom.dat").write_bytes(b"\x00\x01")  # index files are not text
    (src / "ascii-art").write_text("Some drawing that is not prose at all, really not.\n")
    build_fortunes(out, source=src)
    assert read_documents(out) == [
        "A quip that has\na blank line inside it.",
        "He who laughs last thinks slowest.",
    ]


def test_python_docs_corpus_has_one_document_per_topic(tmp_path):
    from pydoc_data.topics import topics

    from mmformer.data.prepare import build_python_docs
    from mmformer.data.text import read_documents

    build_python_docs(tmp_path)
    docs = read_documents(tmp_path)
    assert len(docs) == len(topics) and docs[0].startswith(topics[sorted(topics)[0]].strip()[:30])
