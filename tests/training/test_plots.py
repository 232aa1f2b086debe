"""``mmformer plot RUN`` on a real short run: the curves of every figure are written into the run folder
as PNGs that decode, with one panel per plotted quantity; the classification validation wrote its
prediction grid (one framed cell per held-out image, errors first). The reading and choosing of what to
plot is tested on a hand-written ``metrics.csv``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from mmformer.cli import main
from mmformer.training import pictures as P
from mmformer.training.plots import PANEL_H, PANEL_W, figures, main_metric, read_metrics, smoothed

from .test_pictures import grid_frames


def _png(path: Path) -> torch.Tensor:
    png = PILImage.open(path)
    assert png.format == "PNG"
    return torch.from_numpy(np.array(png.convert("RGB"))).permute(2, 0, 1).float() / 255  # (3, H, W)


@pytest.mark.slow  # a real 2-epoch training run: ~15 s on 2 shared cores
def test_plot_writes_the_curves_of_a_real_run_and_validation_wrote_its_prediction_grid(
    tiny_recipe, workdir, capsys
):
    assert main(["train", str(tiny_recipe), "trainer.max_epochs=2"]) == 0
    (run,) = (workdir / "runs" / "tiny").iterdir()
    capsys.readouterr()
    assert main(["plot", str(run)]) == 0
    printed = capsys.readouterr().out
    panels = {"task-toy": 2, "lr": 1, "throughput": 2, "grad_norm": 1}  # loss + acc; samples/s + TFLOP/s
    for name, n in panels.items():
        path = run / "plots" / f"{name}.png"
        assert str(path) in printed
        img = _png(path)
        assert img.shape == (3, PANEL_H, n * PANEL_W)
        assert img.std() > 0.05  # lines, axes and text on white, not a blank image
    assert "toy: loss; toy: acc" in printed
    assert sorted(p.name for p in (run / "plots").iterdir()) == sorted(f"{n}.png" for n in panels)

    # the recipe's folder names its newest run; a missing run is a usage error (exit 2)
    assert main(["plot", str(run.parent), "--out", str(workdir / "elsewhere")]) == 0
    assert (workdir / "elsewhere" / "task-toy.png").is_file()
    assert main(["plot", str(workdir / "nothing")]) == 2

    # each validation drew its prediction grid: the 8 held-out images, each in a framed cell, errors first
    grids = sorted((run / "predictions").glob("toy-step*.png"))
    assert [g.name for g in grids] == ["toy-step000003.png", "toy-step000007.png"]
    img = _png(grids[-1])
    assert img.shape == (3, 2 * (P.CELL + P.TITLE), 4 * P.CELL)
    frames = grid_frames(img, 4)
    assert len(frames) == 8 and set(frames) <= {"right", "wrong"}
    assert frames == sorted(frames, key=lambda f: f != "wrong")  # every error before every correct one


CSV = """\
epoch,lr,step,train/grad_norm,train/a/loss,train/b/loss,val/a/loss,val/a/acc,val/a/balanced_acc,val/b/loss,val/b/wer,val/b/exact_match,throughput/samples_per_sec
0,0.1,0,2.0,1.0,,,,,,,,
0,0.2,1,1.5,0.8,3.0,,,,,,,50
0,,1,,,,0.7,0.5,0.4,2.5,0.9,0.0,
1,0.1,2,nan,0.6,,,,,,,,60
1,,2,,,,0.5,0.75,0.7,2.0,0.5,0.25,
"""


def test_metrics_are_read_per_column_without_empty_or_non_finite_cells(tmp_path):
    (tmp_path / "metrics.csv").write_text(CSV)
    m = read_metrics(tmp_path / "metrics.csv")
    assert m["train/a/loss"] == ([0, 1, 2], [1.0, 0.8, 0.6])
    assert m["train/grad_norm"] == ([0, 1], [2.0, 1.5])  # the NaN of step 2 left out
    assert m["val/a/acc"] == ([1, 2], [0.5, 0.75])
    assert "epoch" not in m and "step" not in m
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "missing.csv")


def test_the_main_metric_comes_from_the_recipe_else_the_kind_else_a_preference(tmp_path):
    (tmp_path / "metrics.csv").write_text(CSV)
    m = read_metrics(tmp_path / "metrics.csv")
    assert main_metric("a", m) == "acc" and main_metric("b", m) == "wer"  # no recipe: PREFERRED order
    speech = {
        "model": {"tokenizers": {"mel": {"kind": "ast", "sample_rate": 16000}, "img": {"kind": "vit_patch"}}}
    }
    asr = {**speech, "tasks": {"b": {"kind": "prefix_lm", "tokenizer": "mel"}}}
    captions = {**speech, "tasks": {"b": {"kind": "prefix_lm", "tokenizer": "img"}}}
    assert main_metric("b", m, asr) == "wer" and main_metric("b", m, captions) == "exact_match"
    chosen = {"tasks": {"b": {"kind": "seq2seq", "main_metric": "exact_match", "tokenizer": "mel"}}}
    assert main_metric("b", m, chosen) == "exact_match"
    assert main_metric("a", m, {"checkpoint": {"monitor": "val/a/balanced_acc"}}) == "balanced_acc"
    figs = figures(m, asr)
    assert [p.title for p in figs["task-a"]] == ["a: loss", "a: acc"]
    assert [p.title for p in figs["task-b"]] == ["b: loss", "b: wer"]
    assert set(figs["task-a"][0].lines) == {"train", "val"}
    assert [p.title for p in figs["throughput"]] == ["samples / s (all ranks)"]  # nothing else logged
    assert figs["grad_norm"][0].log


def test_smoothing_is_a_debiased_moving_average():
    assert smoothed([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert smoothed([0.0, 1.0], weight=0.5) == pytest.approx([0.0, 0.5 / 0.75])
    assert smoothed([1.0, 3.0], weight=0.0) == [1.0, 3.0]


def test_plot_command_draws_a_metrics_csv_into_its_run_folder(tmp_path, capsys):
    run = tmp_path / "runs" / "r" / "20260101-000000-abcd"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text(CSV)
    assert main(["plot", str(run / "metrics.csv")]) == 0
    printed = capsys.readouterr().out
    sizes = {p.name: _png(p).shape for p in (run / "plots").iterdir()}
    assert sizes == {
        "task-a.png": (3, PANEL_H, 2 * PANEL_W),
        "task-b.png": (3, PANEL_H, 2 * PANEL_W),
        "lr.png": (3, PANEL_H, PANEL_W),
        "throughput.png": (3, PANEL_H, PANEL_W),
        "grad_norm.png": (3, PANEL_H, PANEL_W),
    }
    assert "a: loss; a: acc" in printed and "b: loss; b: wer" in printed
