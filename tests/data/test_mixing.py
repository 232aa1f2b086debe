"""Mixing shard sources in one task (OpenCLIP's ``::`` with ``--train-data-upsampling-factors``): an
epoch visits each source's shards ``factor`` times over, deterministically per seed, dealt by rank and
worker like any shard list, and a resumed epoch reads exactly the rest of the uninterrupted one."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import webdataset as wds

from mmformer.data.roots import DataError
from mmformer.data.shard_sources import MixedShardStream, open_sources
from mmformer.recipe import load_recipe
from tests.conftest import TINY_RECIPE


def _source(folder, name: str, shards: int, per_shard: int = 3) -> str:
    folder.mkdir(parents=True)
    for s in range(shards):
        with wds.TarWriter(str(folder / f"{s}.tar")) as w:
            for j in range(per_shard):
                w.write({"__key__": f"{name}{s}_{j}", "txt": f"{name} {s} {j}"})
    return f"{folder}/{{0..{shards - 1}}}.tar"


@pytest.fixture
def mix(tmp_path, monkeypatch):
    monkeypatch.setenv("MMFORMER_DATA", str(tmp_path / "data"))
    return f"{_source(tmp_path / 'a', 'a', 4)}::{_source(tmp_path / 'b', 'b', 2)}"


def _stream(mix, factors, seed=0, world=1, rank=0, epoch=0, skip=0):
    s = open_sources(mix, "train", True)
    assert s.sources == [(0, 4), (4, 6)] and s.modalities == ["text"]
    stream = MixedShardStream(
        s.root, s.splits["train"], s.sources, factors, lambda raw: {"key": raw["__key__"]}, 2,
        world=world, rank=rank, seed=seed, shuffle_buffer=4,
    )  # fmt: skip
    stream.set_epoch(epoch)
    stream.skip(skip)
    return stream


def _keys(stream, workers=0) -> list[str]:
    loader = torch.utils.data.DataLoader(stream, batch_size=2, num_workers=workers)
    return [k for b in loader for k in b["key"]]


def test_upsampling_factors_repeat_a_source_per_epoch(mix):
    keys = _keys(_stream(mix, [1, 2]))
    assert len(keys) == 12 + 2 * 6  # a once, b twice
    counts = Counter(keys)
    assert all(counts[k] == 1 for k in counts if k.startswith("a"))
    assert all(counts[k] == 2 for k in counts if k.startswith("b")) and len(counts) == 18
    half = Counter(_keys(_stream(mix, [0.5, 1])))  # half of a's shards, a seeded draw
    assert sum(half.values()) == 6 + 6 and sum(k.startswith("a") for k in half) == 6
    assert _keys(_stream(mix, [1, 2])) == keys  # deterministic per seed
    assert _keys(_stream(mix, [1, 2], seed=1)) != keys
    assert _keys(_stream(mix, [1, 2], epoch=1)) != keys


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_mixed_epoch_reads_exactly_the_rest(mix, workers):
    for rank in (0, 1):
        full = _keys(_stream(mix, [1, 2], world=2, rank=rank), workers)
        assert len(full) == 12
        for done in (2, 6, 8):
            assert _keys(_stream(mix, [1, 2], world=2, rank=rank, skip=done), workers) == full[done:]


def test_bad_mixes_are_refused(mix, tmp_path):
    with pytest.raises(DataError, match="1 upsampling factors for 2"):
        _stream(mix, [1])
    with pytest.raises(DataError, match=">= 0 and not all 0"):
        _stream(mix, [0, 0])
    recipe = tmp_path / "r.yaml"
    text = TINY_RECIPE.format(name="mix", root="X").replace(
        "kind: image_folder, root: X", f"kind: shards, root: '{mix}', upsampling_factors: [1, 2, 3]"
    )
    recipe.write_text(text)
    with pytest.raises(Exception, match="upsampling_factors has 3 values for 2 '::' source"):
        load_recipe(recipe)
