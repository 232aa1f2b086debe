"""Image folders: labels, unreadable files reported and skipped, clear errors for missing paths."""

import logging

import numpy as np
import pytest
import torch

from mmformer.data.collate import collate_classification
from mmformer.data.image_folder import ImageFolder, find_classes
from mmformer.data.roots import DataNotFoundError, resolve_root
from mmformer.tokenizers import ImagePreprocess
from tests.conftest import make_image_folder


def _pp():
    return ImagePreprocess(28, 1)


def test_labels_follow_sorted_class_folders(tmp_path):
    root = make_image_folder(tmp_path, n_per_class=3)
    classes = find_classes(root / "train")
    ds = ImageFolder(root / "train", classes, _pp())
    assert classes == ["bright", "dark"] and len(ds) == 6
    item = ds[0]
    assert item["image"].shape == (1, 28, 28) and item["image"].dtype == torch.uint8
    assert item["label"] == 0 and ds[5]["label"] == 1
    assert 180 < item["image"].float().mean() < 220  # 'bright' images are drawn around 200


def test_corrupt_image_is_reported_skipped_and_listed(tmp_path, caplog):
    root = make_image_folder(tmp_path, n_per_class=3)
    bad = root / "train" / "bright" / "000.png"
    bad.write_bytes(b"not a png at all")
    ds = ImageFolder(root / "train", find_classes(root / "train"), _pp())
    with caplog.at_level(logging.WARNING, logger="mmformer.data"):
        item = ds[0]
    assert str(bad) in caplog.text
    assert item["bad_samples"] == [str(bad)]
    assert item["label"] == 0  # replaced by the next readable image
    batch = collate_classification([ds[i] for i in range(len(ds))])
    assert batch["image"].shape == (6, 1, 28, 28) and batch["bad_samples"] == [str(bad)]


def test_missing_path_names_it(tmp_path):
    with pytest.raises(DataNotFoundError, match="does not exist"):
        resolve_root(str(tmp_path / "nowhere"))


def test_a_relative_root_under_the_data_root_is_named(tmp_path, monkeypatch):
    """Only bundled names resolve under MMFORMER_DATA; a relative path that exists there is pointed at."""
    monkeypatch.setenv("MMFORMER_DATA", str(tmp_path / "store"))
    (tmp_path / "store" / "my_set").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataNotFoundError) as e:
        resolve_root("my_set")
    assert str(e.value) == (
        f"data root 'my_set' does not exist (relative to the current directory {tmp_path}). "
        f"'{tmp_path / 'store' / 'my_set'}' exists: only bundled names resolve under the data root; give that path"
    )


def test_path_that_looks_bundled_suggests_prepare(tmp_path, monkeypatch):
    monkeypatch.setenv("MMFORMER_DATA", str(tmp_path))
    with pytest.raises(DataNotFoundError, match="mmformer data prepare mnist5k"):
        resolve_root("data/mnist_5k")


def test_class_folder_unknown_to_training_split(tmp_path):
    root = make_image_folder(tmp_path, n_per_class=2)
    (root / "val" / "extra").mkdir()
    (root / "val" / "bright" / "000.png").rename(root / "val" / "extra" / "000.png")
    with pytest.raises(ValueError, match="not among the training classes"):
        ImageFolder(root / "val", find_classes(root / "train"), _pp())


def test_mnist5k_prepare_is_real_stratified_and_repeatable(tmp_path, monkeypatch):
    pytest.importorskip("PIL")
    from mmformer.data.prepare import BUNDLED, prepare

    monkeypatch.setenv("MMFORMER_DATA", str(tmp_path))
    out = prepare("mnist5k")
    assert BUNDLED["mnist5k"].is_prepared(out)
    train = {c: len(list((out / "train" / str(c)).glob("*.png"))) for c in range(10)}
    val = {c: len(list((out / "val" / str(c)).glob("*.png"))) for c in range(10)}
    assert set(train.values()) == {450} and set(val.values()) == {50}
    first = sorted(p.name for p in (out / "val" / "0").glob("*.png"))
    prepare("mnist5k", force=True)
    assert sorted(p.name for p in (out / "val" / "0").glob("*.png")) == first
    from PIL import Image

    px = np.array(Image.open(next((out / "train" / "1").glob("*.png"))))
    assert px.shape == (28, 28) and px.max() > 200 and px.min() == 0  # a real digit: ink on black


def test_cache_returns_the_same_pixels(tmp_path):
    root = make_image_folder(tmp_path, n_per_class=3)
    classes = find_classes(root / "train")
    plain = ImageFolder(root / "train", classes, _pp())
    cached = ImageFolder(root / "train", classes, _pp(), cache=True)
    first = plain[0]["image"]
    for i in range(len(plain)):
        assert torch.equal(plain[i]["image"], cached[i]["image"])
    (root / "train" / "bright" / "000.png").unlink()  # served from memory from now on
    assert torch.equal(cached[0]["image"], first) and cached[0]["bad_samples"] == []
    assert len(cached.cache) == len(plain)
