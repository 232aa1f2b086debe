"""Other people's WebDataset shards (written with ``webdataset.TarWriter`` alone, no ``index.json``):
counted once and cached, read through ``gopen`` URLs (``pipe:cat``) with brace patterns, resumed
mid-epoch without reopening finished shards, and trained through the CLI with a resume that ends on
the uninterrupted run's weights."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import webdataset as wds
from PIL import Image

from mmformer.cli import main
from mmformer.commands.train import train
from mmformer.data import shard_sources, shards
from mmformer.data.roots import DataError
from mmformer.data.shard_sources import open_sources
from mmformer.data.shards import ShardStream
from mmformer.recipe import load_recipe
from mmformer.training.preemption import Preempted
from tests.conftest import TINY_RECIPE, make_image_folder
from tests.training.test_exact_resume import PreemptAtStep


def write_foreign(folder: Path, out: Path, per_shard: int = 6, caption: bool = False) -> Path:
    """``out/{train,val}-00000N.tar`` from an image class folder, with ``webdataset.TarWriter`` only:
    ``.png`` + ``.cls`` (+ ``.txt``), keys as OpenCLIP's tools write them."""
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        files = sorted((folder / split).glob("*/*.png"))
        classes = sorted({f.parent.name for f in files})
        for s in range(0, len(files), per_shard):
            with wds.TarWriter(str(out / f"{split}-{s // per_shard:06d}.tar")) as w:
                for i, f in enumerate(files[s : s + per_shard], s):
                    sample = {"__key__": f"{split}{i:05d}", "png": f.read_bytes()}
                    sample["cls"] = classes.index(f.parent.name)
                    if caption:
                        sample["txt"] = f"a {f.parent.name} square"
                    w.write(sample)
    return out


@pytest.fixture
def foreign(workdir) -> Path:
    folder = make_image_folder(workdir / "images", n_per_class=12)  # 24 train, 12 val
    return write_foreign(folder, workdir / "foreign")


def _keys(stream, workers: int = 0) -> list[str]:
    loader = torch.utils.data.DataLoader(stream, batch_size=stream.batch_size, num_workers=workers)
    return [k for batch in loader for k in batch["key"]]


def _key(raw: dict) -> dict:
    return {"key": raw["__key__"]}


def test_shards_without_index_are_counted_once_and_cached_beside_them(foreign, monkeypatch):
    train = open_sources(str(foreign), "train", True)
    assert [n for _, n in train.splits["train"]] == [6, 6, 6, 6]
    assert train.modalities == ["image"] and train.max_label == 1
    assert [Path(u).name for u, _ in train.splits["train"]] == [f"train-{i:06d}.tar" for i in range(4)]
    val = open_sources(str(foreign), "val", False)
    assert sum(n for _, n in val.splits["val"]) == 12
    caches = sorted(foreign.glob(".mmformer-counts-*.json"))
    assert len(caches) == 2  # one per shard list
    cached = json.loads(caches[0].read_text())
    assert cached["format"] == "mmformer-shard-counts/1" and cached["extensions"] == ["cls", "png"]

    def no_counting(locations):
        raise AssertionError("counted again")

    monkeypatch.setattr(shard_sources, "count_shards", no_counting)
    assert open_sources(str(foreign), "train", True).splits == train.splits  # read from the cache
    # a shard rewritten (other size / time): counted again
    with wds.TarWriter(str(foreign / "train-000003.tar")) as w:
        w.write({"__key__": "x", "png": (foreign / "train-000000.tar").read_bytes()[:0] + b"\x89", "cls": 0})
    monkeypatch.undo()
    assert [n for _, n in open_sources(str(foreign), "train", True).splits["train"]] == [6, 6, 6, 1]


def test_pipe_urls_with_braces_read_what_the_files_hold_and_cache_in_the_data_root(foreign, workdir):
    spec = f"pipe:cat {foreign}/train-{{000000..000003}}.tar"
    piped = open_sources(spec, "train", True)
    assert [u for u, _ in piped.splits["train"]][0] == f"pipe:cat {foreign}/train-000000.tar"
    assert [n for _, n in piped.splits["train"]] == [6, 6, 6, 6]
    assert len(list((workdir / "data" / ".cache" / "shard-counts").glob("*.json"))) == 1  # URLs: data root
    local = open_sources(str(foreign), "train", True)

    def epoch(s, skip=0, workers=0):
        stream = ShardStream(s.root, s.splits["train"], _key, True, 2, seed=3, shuffle_buffer=4)
        stream.skip(skip)
        return _keys(stream, workers)

    full = epoch(piped)
    assert len(full) == 24 == len(set(full))
    assert epoch(local) == full  # pipe or path: the same samples in the same order
    file_url = open_sources(f"file:{foreign}/train-{{000000..000003}}.tar", "train", True)
    assert epoch(file_url) == full
    for done in (4, 10):
        assert epoch(piped, done, workers=2) == epoch(piped, 0, workers=2)[done:]
    with pytest.raises(DataError, match="val_root"):
        open_sources(spec, "val", False)  # a URL list has no splits


def test_a_resume_does_not_reopen_shards_it_finished(foreign, monkeypatch):
    s = open_sources(f"pipe:cat {foreign}/train-{{000000..000003}}.tar", "train", True)
    opened: list[str] = []
    real = shards.open_shard

    def counting(location):
        opened.append(str(location))
        return real(location)

    monkeypatch.setattr(shards, "open_shard", counting)

    def epoch(skip):
        opened.clear()
        stream = ShardStream(s.root, s.splits["train"], _key, True, 2, seed=0, shuffle_buffer=2)
        stream.skip(skip)
        return _keys(stream), list(opened)

    (full, all_opened), (rest, reopened) = epoch(0), epoch(20)
    assert rest == full[20:] and len(all_opened) == 4
    assert 0 < len(reopened) < 4  # the shards whose samples were all trained are not read again


def test_bad_foreign_specs_are_named(foreign, workdir):
    with pytest.raises(DataError, match="no index.json, no test/ folder and no test-\\*.tar"):
        open_sources(str(foreign), "test", False)
    with pytest.raises(DataError, match=r"train-000004.tar does not exist \(6 of 10 missing\)"):
        open_sources(f"{foreign}/train-{{000000..000009}}.tar", "train", True)
    (workdir / "bad.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(DataError, match="damaged shard"):
        list(shards.read_samples(f"pipe:cat {workdir}/bad.tar"))
    with pytest.raises(DataError, match="empty part"):
        open_sources(f"{foreign}::", "train", True)


def _recipe(workdir: Path, foreign: Path) -> Path:
    root = f"pipe:cat {foreign}/train-{{000000..000003}}.tar"
    text = TINY_RECIPE.format(name="foreign", root="X").replace(
        "kind: image_folder, root: X, batch_size: 4",
        f"kind: shards, root: '{root}', val_root: {foreign}, batch_size: 4, shuffle_buffer: 4",
    )
    path = workdir / "foreign.yaml"
    path.write_text(text)
    return path


def _last_weights(workdir: Path, name: str) -> dict:
    (last,) = (workdir / "runs" / name).glob("*/checkpoints/last.ckpt")
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    return ckpt["global_step"], ckpt["state_dict"]


@pytest.mark.slow  # three short training runs: ~20 s
def test_foreign_shards_train_through_the_cli_and_resume_exactly(foreign, workdir, capsys):
    recipe = _recipe(workdir, foreign)
    base = ["trainer.max_epochs=1", "trainer.val_check_interval=1.0"]
    assert main(["train", str(recipe), *base, "name=full"]) == 0
    assert "val/toy/acc" in capsys.readouterr().out
    steps, full = _last_weights(workdir, "full")
    assert steps == 6  # 24 samples, batch 4
    with pytest.raises(Preempted):
        train(load_recipe(recipe, [*base, "name=part", "logger.mode=disabled"]), [PreemptAtStep(2)])
    stopped, _ = _last_weights(workdir, "part")
    assert 2 <= stopped < 6  # inside the epoch
    assert main(["train", str(recipe), *base, "name=part", "resume=auto"]) == 0
    steps, resumed = _last_weights(workdir, "part")
    assert steps == 6
    for k, v in full.items():
        torch.testing.assert_close(resumed[k], v, atol=1e-6, rtol=0, msg=k)


def test_caption_shards_without_cid_get_ids_from_their_text(workdir):
    from mmformer.data.caption_shards import _caption, text_id

    folder = make_image_folder(workdir / "images", n_per_class=2)
    out = write_foreign(folder, workdir / "captions", caption=True)
    s = open_sources(str(out), "train", True)
    assert s.modalities == ["image", "image_caption"]  # .cls and .txt: read as labelled or captioned
    raws = list(shards.read_samples(s.splits["train"][0][0]))

    class Chars:
        bos_id, eos_id, pad_id = 1, 2, 0

        def encode_batch(self, texts, bos, eos):
            return [[1, *(3 + ord(c) % 50 for c in t), 2] for t in texts]

    ids = [_caption(r, Chars(), 8)["caption_id"] for r in raws]
    texts = [r["txt"].decode() for r in raws]
    assert ids == [text_id(t) for t in texts] and (ids[0] == ids[-1]) == (texts[0] == texts[-1])
    assert len(set(ids)) == len(set(texts)) == 2 and all(0 <= i < 2**62 for i in ids)


def test_image_bytes_round_trip(foreign):
    (raw, *_) = shards.read_samples(foreign / "val-000000.tar")
    with Image.open(io.BytesIO(raw["png"])) as im:
        assert im.size == (28, 28)
