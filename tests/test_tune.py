"""``mmformer tune lr | batch-size`` on the tiny recipe: Lightning's LR finder (a PNG plot that decodes, a
CSV curve, a finite positive suggestion printed as ``optim.lr=…``) and batch-size finder (printed as
``tasks.<task>.data.batch_size=…``)."""

from __future__ import annotations

import csv
import math

from PIL import Image

from mmformer.cli import main


def _override(out: str, key: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith(key + "=")]
    return line.split("=", 1)[1]


def test_tune_lr_saves_the_plot_and_prints_the_suggestion_as_an_override(tiny_recipe, workdir, capsys):
    # batches of 2: 8 steps an epoch; no validation (the finder needs none)
    faster = ["tasks.toy.data.batch_size=2", "trainer.check_val_every_n_epoch=100"]
    assert main(["tune", "lr", str(tiny_recipe), *faster, "--num-training", "16", "--min-lr", "1e-6"]) == 0
    out = capsys.readouterr().out
    lr = float(_override(out, "optim.lr"))
    assert math.isfinite(lr) and 1e-6 <= lr <= 1.0

    folder = workdir / "runs" / "tiny" / "tune"
    (png,) = folder.glob("lr_find-*.png")
    (curve,) = folder.glob("lr_find-*.csv")
    assert f"plot: {png}" in out and f"curve: {curve}" in out
    with Image.open(png) as image:
        image.load()  # decodes the whole file
        assert image.width > 100 and image.height > 100
    with open(curve) as f:
        rows = [(float(r["lr"]), float(r["loss"])) for r in csv.DictReader(f)]
    assert len(rows) == 16
    lrs = [r[0] for r in rows]
    assert lrs == sorted(lrs) and lrs[0] == 1e-6  # an exponential sweep upwards from --min-lr
    assert min(abs(math.log(lr / x)) for x in lrs) < 0.01  # the suggestion is one of the rates tried
    assert not list(folder.glob(".lr_find_*.ckpt"))  # Lightning's temporary checkpoint is gone


def test_tune_batch_size_prints_the_override(tiny_recipe, capsys):
    args = ["tune", "batch-size", str(tiny_recipe), "--steps-per-trial", "1", "--max-val", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # on CPU nothing runs out of memory: power scaling doubles 2 → 4 → 8 and stops at --max-val
    assert _override(out, "tasks.toy.data.batch_size") == "8"
    assert "the search stopped at its limit, 8 (--max-val 8)" in out


def test_tune_batch_size_unknown_task_suggests(tiny_recipe, capsys):
    assert main(["tune", "batch-size", str(tiny_recipe), "--task", "tyo"]) == 2
    assert "--task 'tyo' is not a task of the recipe. Did you mean 'toy'?" in capsys.readouterr().err
