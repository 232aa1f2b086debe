"""The folder rule (docs/data.md): a bad file is named with its file (and line), counted, skipped where
training can go on and refused at load where it cannot; evaluation never substitutes; paths in a shard
index never leave the shard folder. Every case is built from real bytes on disk: an empty image file, a
WAV cut inside its data chunk, invalid UTF-8, a tar shard cut mid-member."""

from __future__ import annotations

import functools
import json
import logging
import tarfile
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch

from mmformer.data.audio import AudioClips, collate_audio, folder_samples, manifest_rows
from mmformer.data.datamodule import MultiTaskDataModule, TaskData
from mmformer.data.image import image_folder_data
from mmformer.data.image_caption import ImageCaptions, collate_captions, read_caption_rows
from mmformer.data.image_folder import ImageFolder, find_classes
from mmformer.data.roots import DataError
from mmformer.data.shards import ShardStream, read_index, write_shards
from mmformer.data.text import read_documents
from mmformer.data.text_classification import read_manifest
from mmformer.tokenizers import ImagePreprocess
from mmformer.tokenizers.audio import AudioPreprocess
from tests.conftest import make_image_folder

TOK = SimpleNamespace(image_size=28, in_chans=1)  # what image_folder_data reads of the image tokenizer


def _named(caplog, text: str) -> int:
    """How many warning lines name ``text``."""
    return sum(text in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def _val_batches(data: TaskData) -> list[dict]:
    dm = MultiTaskDataModule({"t": lambda: data})
    return [steps["t"] for steps, _, _ in dm.val_dataloader()]


def _tone(path, n=1600, rate=8000, **kw):
    sf.write(path, (0.3 * np.sin(np.arange(n) * 0.2)).astype(np.float32), rate, **kw)


# --------------------------------------------------------------------------- item 7: what a folder holds
def test_oga_clips_are_loaded_and_counted(tmp_path):
    split = tmp_path / "train"
    for name, ext, kw in (("vorbis", "oga", {"format": "OGG", "subtype": "VORBIS"}), ("wave", "wav", {})):
        (split / name).mkdir(parents=True)
        for i in range(3):
            _tone(split / name / f"{i}.{ext}", **kw)
    samples, classes = folder_samples(split)
    assert classes == ["vorbis", "wave"]
    assert [(p.rsplit("/", 2)[1:], y) for p, y in samples] == [
        (["vorbis", f"{i}.oga"], 0) for i in range(3)
    ] + [(["wave", f"{i}.wav"], 1) for i in range(3)]
    item = AudioClips(samples, AudioPreprocess(8000))[0]
    assert item["audio"].shape == (1600,) and item["bad_samples"] == []


def test_files_of_other_extensions_are_counted_in_one_warning(tmp_path, caplog):
    root = make_image_folder(tmp_path, n_per_class=2)
    for name in ("notes.txt", "labels.txt", "README.md", ".DS_Store"):
        (root / "train" / "dark" / name).write_text("not an image")
    with caplog.at_level(logging.WARNING, logger="mmformer.data"):
        ds = ImageFolder(root / "train", find_classes(root / "train"), ImagePreprocess(28, 1))
    assert len(ds) == 4
    assert [r.getMessage() for r in caplog.records] == [
        f"skipped 3 files with unsupported extensions (.txt: 2, .md: 1) under {root / 'train'}"
    ]
    audio = tmp_path / "audio" / "train"
    (audio / "a").mkdir(parents=True)
    _tone(audio / "a" / "0.wav")
    (audio / "a" / "0.txt").write_text("transcript")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mmformer.data"):
        assert len(folder_samples(audio)[0]) == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"skipped 1 files with unsupported extensions (.txt: 1) under {audio}"
    ]


def test_a_class_folder_without_a_readable_file_is_refused_naming_it(tmp_path):
    root = make_image_folder(tmp_path, n_per_class=2)
    empty = root / "train" / "grey"
    empty.mkdir()
    (empty / "notes.txt").write_text("no image here")
    with pytest.raises(DataError) as e:
        ImageFolder(root / "train", find_classes(root / "train"), ImagePreprocess(28, 1))
    assert str(e.value).startswith(f"{empty}: class folder 'grey' has no image file that can be read")
    audio = tmp_path / "audio" / "train"
    for name in ("a", "b"):
        (audio / name).mkdir(parents=True)
    _tone(audio / "a" / "0.wav")
    (audio / "b" / "0.xyz").write_bytes(b"\0" * 64)
    with pytest.raises(DataError) as e:
        folder_samples(audio)
    assert str(e.value).startswith(f"{audio / 'b'}: class folder 'b' has no audio file that can be read")


# --------------------------------------------------------------------------- item 15: the expected layout
def test_a_missing_split_folder_shows_the_layout_and_the_key(tmp_path):
    (tmp_path / "images" / "cats").mkdir(parents=True)
    from mmformer.components.datasets.folders import ImageFolderDataConfig

    cfg = ImageFolderDataConfig(root=str(tmp_path / "images"))
    with pytest.raises(DataError) as e:
        image_folder_data(cfg, TOK)
    root = tmp_path / "images"
    assert str(e.value) == (
        f"{root}/train does not exist: an image_folder root holds {root}/train/<class>/<image file> and "
        f"{root}/val/<class>/<image file>; set data.train_split to the name of its training folder "
        f"({root} holds: cats)"
    )


# ------------------------------------------------------------------- item 12: no substitute in evaluation
def test_an_unreadable_validation_image_is_left_out_not_replaced(tmp_path):
    from mmformer.components.datasets.folders import ImageFolderDataConfig

    root = make_image_folder(tmp_path, n_per_class=4)  # val: 2 bright (label 0), 2 dark (label 1)
    empty = root / "val" / "bright" / "002.png"
    empty.write_bytes(b"")  # sorted between the last bright and the first dark image
    cfg = ImageFolderDataConfig(root=str(root), batch_size=2, val_batch_size=1, num_workers=0)
    data = image_folder_data(cfg, TOK)
    batches = _val_batches(data)
    assert [len(b["label"]) for b in batches] == [1, 1, 0, 1, 1]  # the empty file's batch has no row
    assert batches[2]["image"].shape == (0, 1, 28, 28) and batches[2]["bad_samples"] == [str(empty)]
    assert [b["bad_samples"] for i, b in enumerate(batches) if i != 2] == [[], [], [], []]
    assert torch.cat([b["label"] for b in batches]).tolist() == [0, 0, 1, 1]
    pre = ImagePreprocess(28, 1)
    files = [root / "val" / c / f"{i:03d}.png" for c in ("bright", "dark") for i in range(2)]
    from PIL import Image

    want = [pre.load(Image.open(f)) for f in files]
    got = [b["image"][0] for b in batches if len(b["label"])]
    assert all(torch.equal(g, w) for g, w in zip(got, want))  # each valid image exactly once, in order
    # training still replaces it by the next readable image (fixed batch shapes), listing what it replaced
    (root / "train" / "dark" / "000.png").write_bytes(b"")
    train = image_folder_data(cfg, TOK).train
    j = [p for p, _ in train.samples].index(str(root / "train" / "dark" / "000.png"))
    item = train[j]
    assert item["label"] == 1 and item["bad_samples"] == [str(root / "train" / "dark" / "000.png")]


def test_validation_scores_each_readable_image_once_and_counts_the_bad_one(tmp_path, capsys):
    import lightning as L

    from mmformer.build.data import build_datamodule
    from mmformer.build.model import build_module
    from mmformer.recipe.loading import load_recipe
    from mmformer.training.callbacks import BadSampleReport
    from tests.conftest import TINY_RECIPE

    root = make_image_folder(tmp_path / "images", n_per_class=4)
    (root / "val" / "bright" / "002.png").write_bytes(b"")  # alone in its batch of 1: a batch of 0 rows
    (tmp_path / "r.yaml").write_text(TINY_RECIPE.format(name="t", root=root))
    recipe = load_recipe(tmp_path / "r.yaml", ["tasks.toy.data.val_batch_size=1"])
    module, dm = build_module(recipe), build_datamodule(recipe)
    torch.manual_seed(0)
    with torch.no_grad():  # random head weights (it starts at zero: every logit equal)
        for p in module.model.heads.parameters():
            p.normal_(0, 0.5)
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[BadSampleReport()],
    )
    (metrics,) = trainer.validate(module, dm)
    assert capsys.readouterr().out.startswith("data/bad_samples 1\n")  # a validation run alone reports too
    readable = [dm.data["toy"].val[i] for i in (0, 1, 3, 4)]
    batch = {"image": torch.stack([it["image"] for it in readable]), "label": torch.tensor([0, 0, 1, 1])}
    with torch.no_grad():
        logits = module.tasks["toy"].logits(module.model, batch).float()
    assert metrics["val/toy/acc"] == (logits.argmax(-1) == batch["label"]).float().mean().item()
    loss = torch.nn.functional.cross_entropy(logits, batch["label"]).item()
    assert metrics["val/toy/loss"] == pytest.approx(loss, abs=1e-5)


def test_a_bad_file_is_named_once_over_epochs(tmp_path, caplog):
    root = make_image_folder(tmp_path, n_per_class=3)
    bad = root / "train" / "bright" / "001.png"
    bad.write_bytes(b"")
    ds = ImageFolder(root / "train", find_classes(root / "train"), ImagePreprocess(28, 1))
    with caplog.at_level(logging.WARNING, logger="mmformer.data"):
        for _epoch in range(3):
            items = [ds[i] for i in range(len(ds))]
    assert _named(caplog, str(bad)) == 1
    assert [it["bad_samples"] for it in items].count([str(bad)]) == 1


def test_a_run_with_loader_workers_names_each_bad_file_once(tiny_recipe, workdir, capfd):
    from mmformer.cli import main

    bad_train = workdir / "images" / "train" / "dark" / "001.png"
    bad_val = workdir / "images" / "val" / "bright" / "000.png"
    bad_train.write_bytes(b"")
    bad_val.write_bytes(b"\x89PNG cut")
    overrides = ["trainer.max_epochs=3", "tasks.toy.data.num_workers=2"]  # fresh training workers each epoch
    assert main(["train", str(tiny_recipe), *overrides]) == 0
    out, err = capfd.readouterr()
    assert err.count(f"unreadable image skipped: {bad_train}") == 1
    assert err.count(f"unreadable image skipped: {bad_val}") == 1
    assert "data/bad_samples 2" in out
    assert "training replaced 1 by the next readable one, evaluation left 1 out of every metric" in err


def test_the_run_report_counts_replaced_and_left_out_samples_once(capsys, caplog):
    from mmformer.data.bad_samples import report_unreadable
    from mmformer.training.callbacks import BadSampleReport

    report = BadSampleReport()
    trainer = SimpleNamespace(world_size=1, is_global_zero=True)
    for _epoch in range(3):
        report.on_train_batch_end(trainer, None, None, {"t": {"bad_samples": ["/d/a.png", "/d/b.png"]}}, 0)
        report.on_validation_batch_end(trainer, None, None, {"t": {"bad_samples": ["/d/v.png"]}}, 0)
    with caplog.at_level(logging.WARNING):
        report_unreadable("image", "/d/a.png", OSError("empty"))  # a worker forked after: already named
        report.on_fit_end(trainer, None)
    assert capsys.readouterr().out == "data/bad_samples 3\n"
    assert [r.getMessage() for r in caplog.records] == [
        "skipped 3 unreadable sample(s): training replaced 2 by the next readable one, evaluation left 1 "
        "out of every metric; first: /d/a.png, /d/b.png, /d/v.png"
    ]


# --------------------------------------------------------------------------- item 19a: invalid UTF-8
def test_invalid_utf8_in_a_jsonl_manifest_names_the_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"text": "fine", "label": "a"}\n{"text": "caf\xe9", "label": "b"}\n')
    with pytest.raises(DataError) as e:
        read_manifest(path)
    assert str(e.value) == f"{path}:2: not UTF-8 text at column 14 (byte 0xe9: invalid continuation byte)"


def test_invalid_utf8_in_a_corpus_names_the_byte_offset(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"first document\n\nsecond \xff document\n")
    with pytest.raises(DataError) as e:
        read_documents(path)
    assert str(e.value) == f"{path}: not UTF-8 text at byte 23 (line 3; byte 0xff: invalid start byte)"


# --------------------------------------------------------------------------- item 19b/c: shards
def _text_shards(root, n_shards=2, per_shard=5):
    docs = ({"txt": f"document {i} " * 40} for i in range(n_shards * per_shard))
    shards = {"train": write_shards(docs, root, "train", per_shard)}
    docs = ({"txt": f"held out {i} " * 40} for i in range(per_shard))
    shards["val"] = write_shards(docs, root, "val", per_shard)
    info = {"format": "mmformer-webdataset/1", "modality": "text", "classes": [], "splits": shards}
    (root / "index.json").write_text(json.dumps(info))
    return info


def _cut_inside(path, member: int) -> None:
    """Truncate a shard in the middle of the data of its ``member``-th file (text shards: one per sample)."""
    with tarfile.open(path) as tar:
        cut = tar.getmembers()[member]
    path.write_bytes(path.read_bytes()[: cut.offset_data + 10])


def _key(raw: dict) -> dict:
    return {"key": raw["__key__"], "bad_samples": []}


def _keys(batch: list[dict]) -> dict:
    return {"key": [s["key"] for s in batch], "bad_samples": [p for s in batch for p in s["bad_samples"]]}


def test_a_truncated_shard_is_named_and_its_tail_skipped_in_training(tmp_path, caplog):
    info = _text_shards(tmp_path)
    damaged = tmp_path / "train-000001.tar"
    _cut_inside(damaged, 2)  # samples 2, 3, 4 of the shard (keys 7, 8, 9) are lost
    stream = ShardStream(tmp_path, info["splits"]["train"], _key, True, batch_size=2, shuffle_buffer=4)
    with caplog.at_level(logging.WARNING, logger="mmformer.data"):
        for epoch in range(2):
            stream.set_epoch(epoch)
            items = list(stream)
    assert len(items) == 10  # the epoch's quota, filled by reading the other shard again
    assert {it["key"] for it in items} == {f"{i:09d}" for i in range(7)}
    assert {p for it in items for p in it["bad_samples"]} == {f"{damaged}#{k}" for k in (2, 3, 4)}
    assert _named(caplog, str(damaged)) == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"damaged shard {damaged}: ReadError after 2 of its 5 samples (unexpected end of data): "
        "its last 3 samples are skipped"
    ]
    with pytest.raises(DataError, match=f"^{damaged}: damaged shard"):
        stream[9]  # a single read has nothing to fall back on


def test_packed_text_skips_a_truncated_shard_tail_and_counts_it(tmp_path, caplog):
    from mmformer.data.packed_shards import packed_text_stream
    from mmformer.tokenizers.text import TextTokenizer

    info = _text_shards(tmp_path)
    damaged = tmp_path / "train-000001.tar"
    _cut_inside(damaged, 2)
    tok = TextTokenizer.train([f"document {i} " * 40 for i in range(10)], vocab_size=300)
    with caplog.at_level(logging.WARNING, logger="mmformer.data"):
        stream = packed_text_stream(tmp_path, info, "train", tok, 16, 2, seed=0, shuffle_buffer=4)
        windows = list(stream)
    per_doc = [len(tok.encode(f"document {i} " * 40)) + 1 for i in range(10)]  # + eos
    assert stream.tokens == [sum(per_doc[:5]), sum(per_doc[5:7])]  # the lost tail is not counted
    assert len(windows) == stream.per_rank
    assert {p for w in windows for p in w["bad_samples"]} == {f"{damaged}#{k}" for k in (2, 3, 4)}
    assert _named(caplog, str(damaged)) == 1  # counting the tokens met it first; training stays silent


def test_a_truncated_validation_shard_leaves_its_tail_out_of_every_metric(tmp_path):
    info = _text_shards(tmp_path)
    damaged = tmp_path / "val-000000.tar"
    _cut_inside(damaged, 3)  # samples 3 and 4 are lost
    val = ShardStream(tmp_path, info["splits"]["val"], _key, False, batch_size=2)
    data = TaskData(train=val, val=val, collate=_keys, batch_size=2, val_batch_size=2)
    batches = _val_batches(data)
    assert [b["key"] for b in batches] == [["000000000", "000000001"], ["000000002"], []]
    assert [b["bad_samples"] for b in batches] == [[], [f"{damaged}#3"], [f"{damaged}#4"]]


@pytest.mark.parametrize("entry", ["../../outside.tar", "/etc/passwd", "sub/../../x.tar"])
def test_a_shard_name_leaving_the_folder_is_refused(tmp_path, entry):
    info = _text_shards(tmp_path)
    info["splits"]["train"][1][0] = entry
    (tmp_path / "index.json").write_text(json.dumps(info))
    with pytest.raises(DataError) as e:
        read_index(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / 'index.json'}: splits.train[1]: shard {entry!r} is not a file name inside {tmp_path}"
    )


def test_a_shard_missing_from_its_folder_is_refused_at_load(tmp_path):
    _text_shards(tmp_path)
    (tmp_path / "train-000001.tar").unlink()
    with pytest.raises(DataError) as e:
        read_index(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / 'index.json'}: splits.train[1]: shard 'train-000001.tar' is missing from {tmp_path}"
    )


# --------------------------------------------------------------------------- item 19d: null text
def test_a_null_caption_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"image": "a.png", "caption": "a cat"}\n{"image": "b.png", "caption": null}\n')
    with pytest.raises(DataError) as e:
        read_caption_rows(path)
    assert str(e.value) == f"{path}:2: 'caption' must be a string, got null"
    manifest = tmp_path / "clips.jsonl"
    manifest.write_text('{"audio": "a.wav", "label": null}\n')
    with pytest.raises(DataError) as e:
        manifest_rows(manifest)
    assert str(e.value) == f"{manifest}:1: 'label' must be a class name (a string or a number), got null"
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "fine", "label": "a"}\n\n{"text": "also fine", "label": null}\n')
    with pytest.raises(DataError) as e:
        read_manifest(texts)
    assert str(e.value) == f"{texts}:3: 'label' must be a class name (a string or a number), got null"


# --------------------------------------------------------------------------- item 19e: captioned images
def test_a_missing_captioned_image_is_replaced_in_training_and_left_out_of_evaluation(tmp_path, caplog):
    from PIL import Image

    for name in ("b", "c"):
        Image.fromarray(np.full((28, 28), 100, dtype=np.uint8), mode="L").save(tmp_path / f"{name}.png")
    rows = [(str(tmp_path / f"{n}.png"), f"caption {n}") for n in "abc"]  # a.png is missing
    ds = ImageCaptions(rows, [[1, 2], [1, 3], [1, 4]], ImagePreprocess(28, 1))
    with caplog.at_level(logging.WARNING, logger="mmformer.data"):
        item = ds[0]
        ds[0]
    assert item["caption"] == "caption b" and item["bad_samples"] == [rows[0][0]]
    assert _named(caplog, rows[0][0]) == 1
    data = TaskData(
        train=ds,
        val=ds,
        collate=functools.partial(collate_captions, pad_id=0),
        batch_size=3,
        val_batch_size=3,
    )
    (batch,) = _val_batches(data)
    assert batch["caption_text"] == ["caption b", "caption c"] and batch["bad_samples"] == [rows[0][0]]
    assert batch["caption"].tolist() == [[1, 3], [1, 4]] and batch["image"].shape == (2, 1, 28, 28)


# --------------------------------------------------------------------------- item 19f: truncated WAV
def test_a_wav_cut_inside_its_data_chunk_is_a_bad_sample(tmp_path, caplog):
    good, cut = tmp_path / "good.wav", tmp_path / "cut.wav"
    _tone(good)
    _tone(cut)
    cut.write_bytes(cut.read_bytes()[:1000])  # 44-byte header declaring 3200 bytes of samples
    clips = AudioClips([(str(cut), 0), (str(good), 1)], AudioPreprocess(8000))
    with caplog.at_level(logging.WARNING, logger="mmformer.data"):
        item = clips[0]
    assert item["label"] == 1 and item["bad_samples"] == [str(cut)]
    assert caplog.records[0].getMessage() == (
        f"unreadable audio skipped: {cut} (AudioDecodeError: {cut}: cut short: its data chunk declares "
        "3200 bytes, the file holds 956)"
    )
    val = TaskData(train=clips, val=clips, collate=collate_audio, batch_size=2, val_batch_size=2)
    (batch,) = _val_batches(val)
    assert batch["label"].tolist() == [1] and batch["bad_samples"] == [str(cut)]
