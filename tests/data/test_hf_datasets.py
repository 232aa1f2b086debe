"""Local Hugging Face ``datasets`` as a data kind: a ``save_to_disk`` folder and Parquet files give the
same items as the image files they hold, columns are mapped by name (a missing one is named with the
ones there are), a missing optional dependency names its install, and a recipe trains on it."""

from __future__ import annotations

import sys

import datasets  # the hf extra: pip install 'mmformer[hf]' (make test installs it)
import pytest
import torch
from PIL import Image

from mmformer.cli import main
from mmformer.data.hf_datasets import HFSamples, load_splits
from mmformer.data.roots import DataError
from mmformer.data.shards import image_decoder
from mmformer.tokenizers.image import ImagePreprocess
from tests.conftest import TINY_RECIPE, make_image_folder


@pytest.fixture
def digits(workdir):
    """``workdir/hf``: a DatasetDict (train 16 / validation 8) of PNGs in an ``img`` Image column and a
    ``kind`` ClassLabel column (bright, dark); also its rows as Parquet under ``workdir/parquet``."""
    folder = make_image_folder(workdir / "images", n_per_class=8)
    parts = {}
    for split, name in (("train", "train"), ("val", "validation")):
        files = sorted((folder / split).glob("*/*.png"))
        rows = {"img": [str(f) for f in files], "kind": [f.parent.name for f in files]}
        features = datasets.Features(
            {"img": datasets.Image(), "kind": datasets.ClassLabel(names=["bright", "dark"])}
        )
        parts[name] = datasets.Dataset.from_dict(rows, features=features)
    dd = datasets.DatasetDict(parts)
    dd.save_to_disk(str(workdir / "hf"))
    (workdir / "parquet").mkdir()
    for name, ds in dd.items():
        ds.to_parquet(str(workdir / "parquet" / f"{name}-00000-of-00001.parquet"))
    return folder, workdir


def test_rows_decode_as_the_image_files_they_hold(digits):
    folder, workdir = digits
    pre = ImagePreprocess(28, 1)
    files = sorted((folder / "val").glob("*/*.png"))
    for root in (workdir / "hf", workdir / "parquet"):
        table = load_splits(root, ["train", "validation"])["validation"]
        items = HFSamples(table, {"image": "img", "label": "kind"}, image_decoder(pre), f"{root}[validation]")
        assert len(items) == 8
        for i, f in enumerate(files):
            with Image.open(f) as im:
                assert torch.equal(items[i]["image"], pre.load(im))
            assert items[i]["label"] == ["bright", "dark"].index(f.parent.name)


def test_missing_splits_columns_and_library_are_named(digits, monkeypatch):
    _, workdir = digits
    with pytest.raises(DataError, match=r"no 'val' split \(splits: train, validation\)"):
        load_splits(workdir / "hf", ["train", "val"])
    recipe = workdir / "hf.yaml"
    recipe.write_text(_recipe(workdir / "hf", "{image: img, label: knd}"))
    assert main(["train", str(recipe)]) == 2
    from mmformer.data.hf_datasets import column

    table = load_splits(workdir / "hf", ["train"])["train"]
    with pytest.raises(
        DataError, match=r"no column 'knd' for the label; columns: img, kind. Did you mean 'kind'"
    ):
        column(table, "label", {"label": "knd"}, "x")
    with pytest.raises(DataError, match=r"no column 'image' .*data.columns.image"):
        column(table, "image", {}, "x")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"pip install mmformer\[hf\]"):
        load_splits(workdir / "hf", ["train"])


def _recipe(root, columns: str) -> str:
    return TINY_RECIPE.format(name="hf", root="X").replace(
        "kind: image_folder, root: X", f"kind: hf_dataset, root: {root}, columns: {columns}"
    )


@pytest.mark.slow  # a short training run: ~12 s
def test_a_recipe_trains_on_parquet_files(digits, capsys):
    _, workdir = digits
    recipe = workdir / "hf.yaml"
    recipe.write_text(_recipe(workdir / "parquet", "{image: img, label: kind}"))
    assert main(["train", str(recipe), "trainer.max_epochs=1", "tasks.toy.data.val_split=validation"]) == 0
    (acc,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("val/toy/acc ")]
    assert 0.0 <= float(acc.split()[1]) <= 1.0  # 8 validation rows scored
