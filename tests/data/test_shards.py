"""WebDataset shards: `mmformer data shard` writes an image / audio class folder or a text corpus; the
stream deals shards by rank and worker so every training sample is read once per epoch with equal steps
on every rank, shuffles differently each epoch, evaluates every sample exactly once, decodes like the
folder datasets, and trains through the CLI (also as 2-process DDP)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mmformer.cli import main
from mmformer.data.shards import ShardStream, read_index
from tests.conftest import TINY_RECIPE, make_image_folder


def _label_decoder(raw: dict) -> dict:
    return {"key": raw["__key__"]}


def _stream(root, split, train, world=1, rank=0, batch=2, buffer=4, epoch=0):
    info = read_index(root)
    s = ShardStream(root, info["splits"][split], _label_decoder, train, batch, world, rank, 0, buffer)
    s.set_epoch(epoch)
    return s


def _keys(stream, workers: int) -> list[str]:
    loader = torch.utils.data.DataLoader(stream, batch_size=stream.batch_size, num_workers=workers)
    return [k for batch in loader for k in batch["key"]]


@pytest.fixture
def image_shards(workdir):
    folder = make_image_folder(workdir / "images", n_per_class=12)  # 24 train, 12 val
    out = workdir / "shards"
    assert main(["data", "shard", str(folder), "--out", str(out), "--samples-per-shard", "6"]) == 0
    return folder, out


def test_shard_writes_every_sample_with_its_label(image_shards):
    folder, out = image_shards
    info = read_index(out)
    assert info["classes"] == ["bright", "dark"] and info["modality"] == "image"
    assert [n for _, n in info["splits"]["train"]] == [6, 6, 6, 6]  # 2 per rank, 1 per worker
    assert sum(n for _, n in info["splits"]["val"]) == 12


@pytest.mark.parametrize("workers", [0, 2])
def test_training_epoch_reads_each_sample_once_over_ranks_and_workers(image_shards, workers):
    _, out = image_shards
    per_rank = []
    for rank in (0, 1):
        keys = _keys(_stream(out, "train", True, world=2, rank=rank, batch=2), workers)
        per_rank.append(keys)
    # 24 samples, 2 ranks × batch 2: 6 batches per rank, equal on both ranks
    assert len(per_rank[0]) == len(per_rank[1]) == 12
    everything = per_rank[0] + per_rank[1]
    assert len(set(everything)) == len(everything)  # no sample twice in the epoch
    # the next epoch deals and shuffles differently, still without repeats
    again = _keys(_stream(out, "train", True, world=2, rank=0, batch=2, epoch=1), workers)
    assert again != per_rank[0] and len(set(again)) == len(again)
    # a resumed epoch skips what was trained: exactly the rest of this rank's samples, in order (also
    # after an odd number of batches, when the interrupted epoch's next batch was worker 1's)
    for done in (4, 6):
        stream = _stream(out, "train", True, world=2, rank=0, batch=2)
        stream.skip(done)
        assert _keys(stream, workers) == per_rank[0][done:]


def test_evaluation_reads_every_sample_exactly_once_over_ranks(image_shards):
    _, out = image_shards
    keys = [k for rank in (0, 1, 2) for k in _keys(_stream(out, "val", False, world=3, rank=rank), 2)]
    assert len(keys) == 12 and len(set(keys)) == 12
    assert len(_stream(out, "val", False, world=3, rank=0)) == 4


@pytest.mark.parametrize(("world", "batch", "workers"), [(3, 2, 0), (3, 3, 2), (5, 2, 2), (2, 4, 0)])
def test_evaluation_batch_counts_are_known_before_reading(image_shards, world, batch, workers):
    """``eval_batches``: what FSDP2 checks before evaluating (every rank must run as many batches)."""
    _, out = image_shards
    for rank in range(world):
        stream = _stream(out, "val", False, world=world, rank=rank, batch=batch)
        loader = torch.utils.data.DataLoader(stream, batch_size=batch, num_workers=workers)
        assert stream.eval_batches(rank, workers) == sum(1 for _ in loader)


def test_shards_decode_like_the_folder_and_train_through_the_cli(image_shards, workdir, capsys):
    folder, out = image_shards
    recipe = workdir / "tiny.yaml"
    text = TINY_RECIPE.format(name="tiny", root=folder)
    recipe.write_text(text.replace(f"kind: image_folder, root: {folder}", f"kind: shards, root: {out}"))
    assert main(["train", str(recipe), "trainer.max_epochs=1"]) == 0
    finals = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("val/toy/acc")]
    assert finals
    # validation items (no augmentation) equal the folder dataset's, image for image
    from mmformer.build import build_datamodule
    from mmformer.recipe import load_recipe

    from_shards = list(build_datamodule(load_recipe(recipe)).data["toy"].val)
    (workdir / "folder.yaml").write_text(text)
    val = build_datamodule(load_recipe(workdir / "folder.yaml")).data["toy"].val
    from_folder = [val[i] for i in range(len(val))]
    assert len(from_shards) == len(from_folder) == 12
    for item in from_shards:
        assert any(
            torch.equal(item["image"], f["image"]) and item["label"] == f["label"] for f in from_folder
        )


@pytest.mark.slow
def test_ddp_two_processes_train_from_shards(image_shards, workdir):
    folder, out = image_shards
    recipe = workdir / "tiny.yaml"
    text = TINY_RECIPE.format(name="tiny", root=folder)
    recipe.write_text(text.replace(f"kind: image_folder, root: {folder}", f"kind: shards, root: {out}"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmformer.cli",
            "train",
            str(recipe),
            "trainer.devices=2",
            "trainer.strategy=ddp",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("val/toy/acc") == 1


def test_text_shards_split_like_the_corpus_and_audio_shards_decode(workdir):
    import soundfile

    from mmformer.data.text import corpus_split
    from mmformer.tokenizers.audio import AudioPreprocess

    docs = [f"Document {i} says {'word ' * (i % 7)}." for i in range(30)]
    (workdir / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    out = workdir / "text-shards"
    assert main(["data", "shard", str(workdir / "corpus.txt"), "--out", str(out), "--modality", "text",
                 "--val-fraction", "0.2", "--seed", "3"]) == 0  # fmt: skip
    _, train, val = corpus_split(workdir / "corpus.txt", 0.2, 3)
    info = read_index(out)
    assert sum(n for _, n in info["splits"]["val"]) == len(val) and len(val) > 0

    def text_of(raw):
        return {"text": raw["txt"].decode()}

    stream = ShardStream(out, info["splits"]["val"], text_of, False, 1)
    assert sorted(it["text"] for it in stream) == sorted(docs[i] for i in val)

    audio = workdir / "audio"
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("hum", "hiss"):
            (audio / split / cls).mkdir(parents=True)
            for i in range(3):
                soundfile.write(
                    audio / split / cls / f"{i}.wav", rng.normal(0, 0.1, 8000).astype("float32"), 16000
                )
    out = workdir / "audio-shards"
    assert main(["data", "shard", str(audio), "--out", str(out), "--modality", "audio"]) == 0
    info = read_index(out)
    pre = AudioPreprocess(16000, 1.0)
    from mmformer.data.shards import audio_decoder

    stream = ShardStream(out, info["splits"]["val"], audio_decoder(pre), False, 1)
    items = list(stream)
    assert len(items) == 6
    reference = pre.load(audio / "val" / info["classes"][items[0]["label"]] / "0.wav")
    assert any(torch.equal(it["audio"], reference) for it in items)
