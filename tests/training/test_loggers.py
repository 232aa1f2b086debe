"""The loggers of ``logger.kinds`` (W&B, TensorBoard, MLflow beside the CSV log), each read back from
what it wrote: TensorBoard event files, the MLflow file store, the offline W&B ``.wandb`` files (history,
checkpoint artifacts, tables); the one ``wandb sync`` command of a resumed offline run; the W&B URL."""

from __future__ import annotations

import csv
import json
import shlex
import subprocess
import sys
import wave
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from PIL import Image as PILImage

from mmformer.cli import main
from mmformer.commands import train as train_cmd
from mmformer.commands.train import train
from mmformer.recipe import load_recipe
from mmformer.training.callbacks import MediaSamples
from mmformer.training.checkpoint_io import LastCheckpoint
from mmformer.training.loggers import (
    ContinuingWandbLogger,
    _checkpoint_files,
    wandb_run_url,
    wandb_sync_command,
)
from mmformer.training.media import Audio, Image, Table
from tests.wandb_records import history_and_config, read_records


@pytest.fixture(autouse=True)
def _wandb_files_in_tmp(workdir, monkeypatch):
    """Artifact staging copies and W&B's own caches stay in the test's folder, not in ~."""
    for var, sub in (
        ("WANDB_DATA_DIR", "wb-data"),
        ("WANDB_CACHE_DIR", "wb-cache"),
        ("WANDB_CONFIG_DIR", "wb-cfg"),
    ):
        monkeypatch.setenv(var, str(workdir / sub))


def _csv(run: Path, key: str) -> dict[int, float]:
    rows = csv.DictReader(open(run / "metrics.csv"))
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


def _one_run(workdir: Path, name: str) -> Path:
    (run,) = [p for p in (workdir / "runs" / name).iterdir() if p.is_dir()]
    return run


KINDS = "logger.kinds=[tensorboard,mlflow]"


def _tensorboard(run: Path, key: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(key)}


def _mlflow(workdir: Path):
    """``(client, the one run of the runs folder's file store)``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(workdir / "runs" / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("mmformer")
    (found,) = client.search_runs([experiment.experiment_id])
    return client, found


def test_tensorboard_and_mlflow_hold_the_metrics_and_the_recipe(tiny_recipe, workdir):
    train(load_recipe(tiny_recipe, [KINDS, "trainer.max_epochs=1"]))
    run = _one_run(workdir, "tiny")
    loss, acc = _csv(run, "train/loss"), _csv(run, "val/toy/acc")
    assert sorted(loss) == [0, 1, 2, 3] and sorted(acc) == [3]  # 4 steps, one validation after them

    assert _tensorboard(run, "train/loss") == pytest.approx(loss, abs=1e-6)
    assert _tensorboard(run, "val/toy/acc") == pytest.approx(acc, abs=1e-6)

    client, found = _mlflow(workdir)
    assert found.data.tags["mlflow.runName"] == f"tiny/{run.name}" and found.info.status == "FINISHED"
    assert found.data.params["optim/lr"] == "0.003" and found.data.params["trainer/max_epochs"] == "1"
    history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "train/loss")}
    assert history == pytest.approx(loss, abs=1e-6)
    val = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "val/toy/acc")}
    assert val == pytest.approx(acc, abs=1e-6)


@pytest.mark.slow
def test_a_resumed_run_continues_its_mlflow_run_and_tensorboard_folder(tiny_recipe, workdir):
    train(load_recipe(tiny_recipe, [KINDS, "trainer.max_epochs=1"]))
    _, first = _mlflow(workdir)
    # resumed with a changed recipe: the same MLflow run continues (its parameters keep their values,
    # which MLflow cannot change), and TensorBoard's folder gets the new steps
    train(load_recipe(tiny_recipe, [KINDS, "trainer.max_epochs=2", "resume=auto"]))
    run = _one_run(workdir, "tiny")
    client, again = _mlflow(workdir)
    assert again.info.run_id == first.info.run_id and again.info.status == "FINISHED"
    assert again.data.params["trainer/max_epochs"] == "1"
    history = {m.step: m.value for m in client.get_metric_history(again.info.run_id, "train/loss")}
    assert sorted(history) == list(range(8)) and history == pytest.approx(_csv(run, "train/loss"), abs=1e-6)
    assert sorted(_tensorboard(run, "val/toy/acc")) == [3, 7]


def _artifacts(folder: Path) -> list:
    records = read_records(next(folder.glob("*.wandb")))
    return [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]


@pytest.mark.slow
def test_offline_resume_ends_with_one_sync_command_for_every_segment_and_last_checkpoint_artifacts(
    tiny_recipe, workdir, capsys
):
    args = ["train", str(tiny_recipe), "logger.mode=offline", "logger.log_model=last"]
    assert main([*args, "trainer.max_epochs=1"]) == 0
    assert main([*args, "trainer.max_epochs=2", "resume=auto"]) == 0
    out = capsys.readouterr().out
    run = _one_run(workdir, "tiny")
    wandb_id = json.loads((run / "run.json").read_text())["wandb_id"]
    segments = sorted((run / "wandb").glob("offline-run-*"))
    assert len(segments) == 2 and "W&B run: " not in out  # offline: no URL

    line = [x for x in out.splitlines() if "wandb sync" in x][-1]
    words = shlex.split(line[line.index("wandb sync") :])
    assert words == ["wandb", "sync", "--id", wandb_id, *map(str, segments)]
    # what wandb's own CLI would upload from that command: both segments' files
    listed = subprocess.run(
        [str(Path(sys.executable).with_name("wandb")), "sync", "--dry-run", *words[2:]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    text = listed.stdout + listed.stderr
    assert "Would sync 2 run(s)" in text
    assert all(next(s.glob("*.wandb")).name in text and s.name in text for s in segments)

    # each fit that ended sent last.ckpt once, as a version of the run's model artifact
    for segment in segments:
        (artifact,) = _artifacts(segment)
        assert artifact.name == f"model-{wandb_id}" and artifact.type == "model"
        assert "last" in artifact.aliases and "best" not in artifact.aliases
        assert [e.path for e in artifact.manifest.contents] == ["model.ckpt"]
        assert json.loads(artifact.metadata)["original_filename"] == "last.ckpt"
    last_size = (run / "checkpoints" / "last.ckpt").stat().st_size
    assert _artifacts(segments[1])[0].manifest.contents[0].size == last_size


def test_log_model_picks_the_files_it_names(tmp_path):
    last = LastCheckpoint(str(tmp_path))
    (tmp_path / "last.ckpt").write_bytes(b"l")
    best = ModelCheckpoint(dirpath=str(tmp_path), monitor="val/toy/acc", mode="max", save_top_k=2)
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    for p in (a, b):
        Path(p).write_bytes(b"x")
    best.best_k_models, best.best_model_path = {a: torch.tensor(0.5), b: torch.tensor(0.75)}, b

    def names(callback, which):
        return [(Path(p).name, aliases) for p, aliases, _ in _checkpoint_files(callback, which)]

    assert names(last, "last") == [("last.ckpt", ["last"])] and names(best, "last") == []
    assert names(best, "best") == [("b.ckpt", ["best"])] and names(last, "best") == []
    assert names(best, "all") == [("a.ckpt", []), ("b.ckpt", ["best"])]
    assert names(last, "all") == [("last.ckpt", ["last"])]
    (_, _, meta), _ = _checkpoint_files(best, "all")[1], None
    assert meta == {"original_filename": "b.ckpt", "monitor": "val/toy/acc", "score": 0.75}


class _OnlineRun:
    """What an online ``wandb.Run`` shows the logger (no server is reached)."""

    offline, disabled, id = False, False, "abc123"
    url = "https://wandb.ai/me/mmformer/runs/abc123"


def test_an_online_run_url_is_printed_at_the_end(capsys, tmp_path):
    logger = ContinuingWandbLogger(experiment=_OnlineRun(), project="mmformer")
    assert logger.experiment.id == "abc123" and wandb_run_url([logger]) == _OnlineRun.url
    trainer = SimpleNamespace(callback_metrics={"val/toy/acc": torch.tensor(0.5)}, loggers=[logger])
    run = SimpleNamespace(dir=tmp_path, checkpoints=tmp_path / "checkpoints", wandb_id="abc123")
    train_cmd._report(trainer, run)
    out = capsys.readouterr().out
    assert f"W&B run: {_OnlineRun.url}" in out and "wandb sync" not in out
    assert "anonymous" not in logger._wandb_init  # the cause of W&B's "anonymous setting" warning


def test_an_offline_wandb_start_warns_of_nothing(workdir, monkeypatch):
    import wandb

    warned: list[str] = []
    monkeypatch.setattr(wandb, "termwarn", lambda message, *a, **k: warned.append(str(message)))
    logger = ContinuingWandbLogger(
        name="t", save_dir=str(workdir), id="noanon1", project="mmformer", mode="offline"
    )
    try:
        assert logger.experiment.offline and logger.url is None and wandb_run_url([logger]) is None
    finally:
        logger.experiment.finish()
    assert warned == []  # no "anonymous setting has no effect", no "URL not available in offline run"
    wandb.Settings(anonymous=None)  # what Lightning's WandbLogger passes: the warning the test would see
    assert any("anonymous setting has no effect" in w for w in warned)
    assert wandb_sync_command(workdir, "noanon1") == shlex.join(
        ["wandb", "sync", "--id", "noanon1", str(next((workdir / "wandb").glob("offline-run-*-noanon1")))]
    )


def test_a_wandb_table_carries_the_image_and_the_clip_beside_the_text(workdir):
    logger = ContinuingWandbLogger(
        name="t", save_dir=str(workdir), id="table1", project="mmformer", mode="offline"
    )
    picture = torch.zeros(3, 4, 6)
    picture[0] = 1.0  # red
    table = Table(
        "decoded",
        ["input", "clip", "reference", "decoded"],
        [[Image("in", picture, "a red square"), Audio(torch.linspace(-1, 1, 800), 8000), "a red", "a rod"]],
    )
    trainer = SimpleNamespace(
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=3)),
        default_root_dir=str(workdir),
        loggers=[logger],
    )
    try:
        MediaSamples()._log(trainer, "captions", table)
        folder = Path(logger.experiment.dir).parent
    finally:
        logger.experiment.finish()
    rows, _ = history_and_config(next(folder.glob("*.wandb")))
    key = "decoded/captions/"  # the history row points at the table (its fields, as nested keys)
    (cell,) = [
        {k.removeprefix(key): v for k, v in r.items() if k.startswith(key)}
        for r in rows
        if key + "_type" in r
    ]
    assert cell["_type"] == "table-file" and (cell["ncols"], cell["nrows"]) == (4, 1)
    # the table itself, with its media files, is the run's run_table artifact (staged for wandb sync)
    (artifact,) = [a for a in _artifacts(folder) if a.type == "run_table"]
    files = {e.path: Path(e.local_path) for e in artifact.manifest.contents}
    data = json.loads(files["decoded/captions.table.json"].read_text())
    assert data["columns"] == ["input", "clip", "reference", "decoded"]
    image, clip, reference, decoded = data["data"][0]
    assert image["_type"] == "image-file" and (image["width"], image["height"]) == (6, 4)
    assert image["caption"] == "a red square" and clip["_type"] == "audio-file"
    assert (reference, decoded) == ("a red", "a rod")
    assert PILImage.open(files[image["path"]]).convert("RGB").getpixel((0, 0)) == (255, 0, 0)
    with wave.open(str(files[clip["path"]])) as w:
        assert (w.getframerate(), w.getnframes()) == (8000, 800)


def test_bad_logger_keys_and_a_missing_package_are_named(tiny_recipe, monkeypatch, capsys):
    assert main(["train", str(tiny_recipe), "logger.kinds=[tensorbord]"]) == 2
    err = capsys.readouterr().err
    assert "logger" in err and "'tensorbord'" in err and "Did you mean 'tensorboard'?" in err
    assert main(["train", str(tiny_recipe), "logger.log_model=bst"]) == 2
    assert "Did you mean 'best'?" in capsys.readouterr().err
    assert load_recipe(tiny_recipe, ["logger.log_model=false"]).logger.log_model == "false"

    monkeypatch.setitem(sys.modules, "mlflow", None)  # as on a clone without the loggers extra
    assert main(["train", str(tiny_recipe), "logger.kinds=[mlflow]"]) == 2
    err = capsys.readouterr().err
    assert "mlflow" in err and "pip install 'mmformer[loggers]'" in err
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # a dependency of mmformer, yet uninstallable
    assert main(["train", str(tiny_recipe), "logger.kinds=[tensorboard]"]) == 2
    assert "pip install tensorboard (or leave it out" in capsys.readouterr().err
