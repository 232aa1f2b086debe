"""Storage faults and bad checkpoints end in one line naming the file, never a torch traceback.

Writing: a full disk (a real size-limited tmpfs where the tests may mount one, else a writer that fails
with ENOSPC) or a read-only folder keeps the previous ``last.ckpt`` whole and leaves no temporary file.
Reading: a pickled payload (refused, nothing of it runs), a foreign, empty or truncated file, through
every loader (``validate`` / ``sample`` / ``generate`` / ``export``, ``resume=``); ``resume=auto`` falls
back past a damaged ``last.ckpt`` to the newest intact checkpoint of its run and says so. A checkpoint's
stored recipe is read as written (no ``${oc.env:…}`` resolved)."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mmformer.build import load_checkpoint
from mmformer.cli import main
from mmformer.errors import RecipeError, UsageError
from mmformer.evaluation import load_checkpoint as load_task_checkpoint
from mmformer.recipe import load_recipe, recipe_to_yaml
from mmformer.training import checkpoint_io
from mmformer.training.checkpoint_io import AtomicCheckpointIO, CheckpointError, read_checkpoint_file
from mmformer.training.runs import open_run
from mmformer.training.sharded import read_checkpoint, read_meta

RAN: list[str] = []  # what a pickled payload would have run


def _payload() -> None:
    RAN.append("pickled code ran")


class Payload:
    """Unpickling this calls ``_payload``: a stand-in for the code a malicious checkpoint carries."""

    def __reduce__(self):
        return (_payload, ())


@pytest.fixture
def mmformer_log():
    """The lines ``mmformer``'s logger wrote during the test."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("mmformer")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old)


def _save(path: Path, step: int, recipe_yaml: str = "name: tiny\n") -> dict:
    """A training-like checkpoint (what Lightning and ``on_save_checkpoint`` write) at ``step``."""
    ckpt = {
        "epoch": step // 4,
        "global_step": step,
        "state_dict": {"model.w": torch.full((64,), float(step))},
        "mmformer": {"recipe_yaml": recipe_yaml, "tokenizers": {}, "pretrained": {}},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return ckpt


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert lines and lines[-1].startswith("mmformer: error: "), err
    return lines[-1].removeprefix("mmformer: error: ")


def _mount_tmpfs(where: Path, options: str) -> Path:
    """A real size-limited (or read-only) file system at ``where``; skips where mounting is not allowed."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    return where


def _unmount(where: Path) -> None:
    if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def small_fs(tmp_path):
    """A real 256 KiB file system (tmpfs)."""
    mnt = _mount_tmpfs(tmp_path / "small", "size=256k")
    yield mnt
    _unmount(mnt)


# --------------------------------------------------------------------------------------- item 10: writes
def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(small_fs):
    io_ = AtomicCheckpointIO()
    path = small_fs / "last.ckpt"
    io_.save_checkpoint({"w": torch.ones(1000)}, path)  # 4 kB: fits
    with pytest.raises(CheckpointError) as e:
        io_.save_checkpoint({"w": torch.zeros(200_000)}, path)  # 800 kB: does not
    msg = str(e.value)
    assert msg.startswith(f"disk full while writing {path}: it needs ~0.8 MB, ")
    assert f"MB free on {small_fs}" in msg and "the previous last.ckpt is kept" in msg and "\n" not in msg
    assert torch.equal(io_.load_checkpoint(path)["w"], torch.ones(1000))
    assert sorted(p.name for p in small_fs.iterdir()) == ["last.ckpt"]  # no temporary left


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
        RuntimeError("[enforce fail at inline_container.cc:300] . PytorchStreamWriter failed writing file"),
    ],
    ids=["ENOSPC", "unexpected_pos", "file_write_failed"],
)
def test_a_writer_that_runs_out_of_space_midway(tmp_path, monkeypatch, failure):
    """Where no small file system can be mounted: half the bytes reach the file, then the disk is full."""
    io_ = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io_.save_checkpoint({"w": torch.ones(10)}, path)
    real_save = torch.save

    def half_then_full(obj, f, *a, **k):
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: buf.tell() // 2])
        raise failure

    monkeypatch.setattr(torch, "save", half_then_full)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage", lambda p: usage._replace(free=100_000))
    with pytest.raises(
        CheckpointError, match=rf"^disk full while writing {path}: it needs ~4\.0 MB, 0\.1 MB free"
    ):
        io_.save_checkpoint({"w": torch.zeros(1_000_000)}, path)
    monkeypatch.undo()
    assert torch.equal(io_.load_checkpoint(path)["w"], torch.ones(10))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_write_failure_with_space_left_is_not_called_a_full_disk(tmp_path, monkeypatch):
    def broken(obj, f, *a, **k):
        f.write(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", broken)
    path = tmp_path / "last.ckpt"
    with pytest.raises(CheckpointError, match=rf"^could not write {path}: the file system refused the write"):
        AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(10)}, path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stage", ["fsync", "replace"])
def test_no_temporary_file_is_left_whatever_step_fails(tmp_path, monkeypatch, stage):
    io_ = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io_.save_checkpoint({"step": 1}, path)

    def fail(*a, **k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(checkpoint_io.os, stage, fail)
    with pytest.raises(CheckpointError, match=rf"^could not write {path}: Input/output error"):
        io_.save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert io_.load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_mmformer_train_on_a_full_disk_exits_with_one_line(tiny_recipe, workdir, monkeypatch, capsys):
    runs = _mount_tmpfs(workdir / "full", "size=128k")  # recipe.yaml, run.json fit; a checkpoint does not
    try:
        monkeypatch.setenv("MMFORMER_RUNS", str(runs))
        assert main(["train", str(tiny_recipe), "trainer.max_epochs=1", "trainer.limit_train_batches=1"]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert line.startswith(f"disk full while writing {runs}/tiny/") and f"MB free on {runs}" in line
        assert not [p for p in runs.rglob("*") if p.name.endswith(".tmp")]
    finally:
        _unmount(runs)


def test_a_read_only_runs_folder_is_named(workdir):
    root = workdir / "runs"
    root.mkdir()
    root.chmod(0o555)
    try:
        if os.access(root, os.W_OK):
            pytest.skip("chmod does not bite here (root, with CAP_DAC_OVERRIDE)")
        with pytest.raises(
            UsageError, match=rf"^runs folder {root} is read-only: cannot write the run folder "
        ):
            open_run("tiny", None)
    finally:
        root.chmod(0o755)


def test_a_runs_folder_on_a_read_only_file_system_is_named(workdir, monkeypatch):
    root = _mount_tmpfs(workdir / "ro", "ro,size=64k")
    try:
        monkeypatch.setenv("MMFORMER_RUNS", str(root / "runs"))
        with pytest.raises(
            UsageError,
            match=rf"^folder {root} is read-only: cannot write the run folder {root}/runs/tiny/\S+ \(set MMFORMER_RUNS",
        ):
            open_run("tiny", None)
    finally:
        _unmount(root)


def test_saving_into_a_read_only_file_system_keeps_the_previous_checkpoint(small_fs):
    path = small_fs / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1}, path)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    with pytest.raises(CheckpointError, match=rf"^could not write {path}: {small_fs} is read-only"):
        AtomicCheckpointIO().save_checkpoint({"step": 2}, path)
    assert AtomicCheckpointIO().load_checkpoint(path)["step"] == 1


# ---------------------------------------------------------------------- items 11 and 14: bad checkpoints
def _unsafe(path: Path) -> Path:
    torch.save({"state_dict": {}, "x": Payload()}, path)
    return path


def _empty(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _truncated(path: Path) -> Path:
    _save(path, 4)
    _truncate(path)
    return path


def _text(path: Path) -> Path:
    path.write_text("model:\n  backbone: debug\n")
    return path


BAD = {
    "unsafe": (
        _unsafe,
        r"is not a weights-only checkpoint and was refused for safety \(it would run pickled code: "
        r"tests\.training\.test_checkpoint_faults\._payload\)$",
    ),
    "empty": (_empty, r"is empty \(0 bytes: its save never finished\)$"),
    "truncated": (_truncated, r"is truncated \(\d+ bytes: the end of its zip archive is missing\)$"),
    "text": (_text, r"is not a PyTorch checkpoint \(neither a torch\.save zip archive nor a legacy one\)$"),
}


@pytest.mark.parametrize("kind", BAD)
def test_a_bad_checkpoint_is_named_by_every_loader(workdir, kind):
    make, what = BAD[kind]
    path = make(workdir / f"{kind}.ckpt")
    loaders = {
        "read_checkpoint_file": lambda: read_checkpoint_file(path),
        "read_checkpoint_file(mmap)": lambda: read_checkpoint_file(path, mmap=True),
        "lightning resume": lambda: AtomicCheckpointIO().load_checkpoint(path),
        "read_meta": lambda: read_meta(path),
        "read_checkpoint": lambda: read_checkpoint(path),
        "load_checkpoint": lambda: load_checkpoint(path),
        "evaluation.load_checkpoint": lambda: load_task_checkpoint(path, "classification"),
        "resume=PATH": lambda: open_run("tiny", str(path)),
    }
    for load in loaders.values():
        with pytest.raises(CheckpointError, match=f"^{path} {what}"):
            load()
    assert RAN == []  # nothing of a pickled payload ran


@pytest.mark.parametrize("kind", ["unsafe", "truncated", "empty"])
@pytest.mark.parametrize(
    "command",
    [
        ["validate", "{ckpt}"],
        ["export", "{ckpt}", "{out}"],
        ["sample", "{ckpt}", "--out", "{out}.png"],
        ["generate", "{ckpt}", "--prompt", "hi"],
        ["train", "{recipe}", "resume={ckpt}"],
    ],
    ids=lambda c: c if isinstance(c, str) else c[0],
)
def test_every_command_says_it_in_one_line(tiny_recipe, workdir, capsys, kind, command):
    make, what = BAD[kind]
    path = make(workdir / f"{kind}.ckpt")
    argv = [a.format(ckpt=path, out=workdir / "out", recipe=tiny_recipe) for a in command]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"{path} ") and re.search(what, line), line
    assert RAN == []


def test_a_foreign_weights_only_file_is_not_an_mmformer_checkpoint(workdir):
    path = workdir / "resnet.pth"
    torch.save({"conv1.weight": torch.zeros(2, 3)}, path)
    with pytest.raises(RecipeError, match=rf"^{path} is not an mmformer training checkpoint \(no recipe "):
        load_checkpoint(path)
    with pytest.raises(
        CheckpointError, match=rf"^{path} is not an mmformer training checkpoint \(no recipe "
    ):
        open_run("tiny", str(path))


# ------------------------------------------------------------------------------------ resume=auto
def _run_folder(workdir, run_id="20260101-000000-abcd") -> Path:
    return workdir / "runs" / "tiny" / run_id / "checkpoints"


def test_resume_auto_falls_back_past_a_damaged_last_checkpoint(workdir, mmformer_log):
    ck = _run_folder(workdir)
    _save(ck / "best-epoch000-step000004.ckpt", 4)
    _save(ck / "last.ckpt", 6)
    _truncate(ck / "last.ckpt")
    run = open_run("tiny", "auto")
    assert run.resume_from == ck / "best-epoch000-step000004.ckpt" and run.dir == ck.parent
    (line,) = mmformer_log
    assert line.startswith(f"resume=auto: {ck / 'last.ckpt'} is truncated (")
    assert line.endswith(
        f"; resuming from {ck / 'best-epoch000-step000004.ckpt'}, the newest intact checkpoint of run {ck.parent.name}"
    )


def test_resume_auto_over_an_empty_last_checkpoint_takes_the_newest_intact_one(workdir, mmformer_log):
    ck = _run_folder(workdir)
    _save(ck / "best-epoch000-step000004.ckpt", 4)
    _save(ck / "best-epoch001-step000008.ckpt", 8)
    os.utime(ck / "best-epoch000-step000004.ckpt", (1, 1))  # the older one
    (ck / "last.ckpt").write_bytes(b"")
    assert open_run("tiny", "auto").resume_from == ck / "best-epoch001-step000008.ckpt"
    assert mmformer_log[0].startswith(
        f"resume=auto: {ck / 'last.ckpt'} is empty (0 bytes: its save never finished)"
    )


def test_resume_auto_passes_over_runs_of_another_model_and_says_so(workdir, mmformer_log):
    """A kernel sweep over one recipe name: ``resume=auto`` continues the run of the model asked for,
    never another kernel's run (its weights trained as another model, two models in one record). What
    differs is ``recipe.model_changes``' to say (tests/test_model_changes.py); here, a stand-in that
    reads the kernel, against the recipe each run last trained with."""
    runs = {}
    for age, (run_id, kernel) in enumerate(
        [("20260101-000000-sdpa", "sdpa"), ("20260102-000000-lsh0", "lsh")]
    ):
        ck = _run_folder(workdir, run_id)
        _save(ck / "last.ckpt", 4)
        (ck.parent / "recipe.yaml").write_text(f"attn_kernel: {kernel}\n")
        os.utime(ck / "last.ckpt", (1000 + age, 1000 + age))  # the lsh run is the newest
        runs[kernel] = ck

    def asking(kernel):
        def changes(saved: str) -> list[str]:
            old = saved.split(": ")[1].strip()
            return [] if old == kernel else [f"model.backbone.attn_kernel: {old!r} → {kernel!r}"]

        return changes

    assert open_run("tiny", "auto", asking("sdpa")).resume_from == runs["sdpa"] / "last.ckpt"
    assert mmformer_log == [
        "resume=auto: not resuming 20260102-000000-lsh0 (model.backbone.attn_kernel: 'lsh' → 'sdpa'): "
        "another model than this recipe's (resume=PATH continues one anyway)"
    ]
    mmformer_log.clear()
    run = open_run("tiny", "auto", asking("performer"))  # no run of that model: a new one
    assert run.resume_from is None and run.dir.name not in {"20260101-000000-sdpa", "20260102-000000-lsh0"}
    assert mmformer_log[0].startswith("resume=auto: not resuming 20260102-000000-lsh0 (")
    assert "; 20260101-000000-sdpa (model.backbone.attn_kernel: 'sdpa' → 'performer')" in mmformer_log[0]
    assert mmformer_log[1].startswith("resume=auto: no run of recipe 'tiny' under ")
    assert mmformer_log[1].endswith(f"trained this recipe's model; starting a new run in {run.dir}")
    assert open_run("tiny", "auto").resume_from == runs["lsh"] / "last.ckpt"  # nothing asked: the newest
    # a run resumed with another model (saved as recipe.resume-N.yaml) is that model's run now
    for n, kernel in ((1, "flex"), (2, "lsh"), (10, "performer")):
        (runs["lsh"].parent / f"recipe.resume-{n}.yaml").write_text(f"attn_kernel: {kernel}\n")
    mmformer_log.clear()
    assert open_run("tiny", "auto", asking("performer")).resume_from == runs["lsh"] / "last.ckpt"
    assert not mmformer_log


def test_resume_auto_stops_and_lists_the_checkpoints_when_none_is_intact(workdir):
    ck = _run_folder(workdir)
    _truncated(ck / "best-epoch000-step000004.ckpt")
    (ck / "last.ckpt").write_bytes(b"")
    size = (ck / "best-epoch000-step000004.ckpt").stat().st_size
    with pytest.raises(CheckpointError) as e:
        open_run("tiny", "auto")
    assert str(e.value) == (
        f"resume=auto: no intact checkpoint in {ck}: last.ckpt is empty (0 bytes: its save never finished); "
        f"best-epoch000-step000004.ckpt is truncated ({size} bytes: the end of its zip archive is missing). "
        "Name one with resume=PATH, or start a new run without resume"
    )


def test_resume_auto_without_a_checkpoint_says_it_starts_a_new_run(workdir, mmformer_log):
    ck = _run_folder(workdir)
    ck.mkdir(parents=True)
    (ck / ".last.ckpt.4242.tmp").write_bytes(b"")  # a save killed before it wrote anything
    run = open_run("tiny", "auto")
    assert run.resume_from is None and run.dir != ck.parent
    assert mmformer_log == [
        f"resume=auto: no last.ckpt of recipe 'tiny' under {workdir / 'runs' / 'tiny'} (an unfinished save "
        f"left {ck / '.last.ckpt.4242.tmp'}); starting a new run in {run.dir}"
    ]


# --------------------------------------------------------------------------- the stored recipe, as written
def test_a_stored_recipe_is_read_without_resolving_interpolations(tiny_recipe, workdir, monkeypatch):
    recipe = load_recipe(tiny_recipe)
    recipe.logger.project = "${oc.env:MMFORMER_TEST_SECRET}"
    recipe.logger.group = "C:\\${oc.env:MMFORMER_TEST_SECRET}\\runs"  # a backslash before it, kept too
    path = workdir / "stored.ckpt"
    _save(path, 4, recipe_to_yaml(recipe))
    monkeypatch.delenv("MMFORMER_TEST_SECRET", raising=False)
    loaded = load_checkpoint(path)  # an unset variable: no error
    assert loaded.recipe.logger.project == "${oc.env:MMFORMER_TEST_SECRET}"
    assert loaded.recipe.logger.group == "C:\\${oc.env:MMFORMER_TEST_SECRET}\\runs"
    monkeypatch.setenv("MMFORMER_TEST_SECRET", "leaked")
    loaded = load_checkpoint(path, ["logger.entity=${oc.env:MMFORMER_TEST_SECRET}"])
    assert loaded.recipe.logger.project == "${oc.env:MMFORMER_TEST_SECRET}"
    assert loaded.recipe.logger.entity == "leaked"  # the user's own override still resolves


# ----------------------------------------------------------------------- the non-finite stop tells the truth
def _nan_from(monkeypatch, first_bad: int) -> None:
    from mmformer.tasks.classification import ClassificationTask

    original, calls = ClassificationTask.training_loss, {"n": 0}

    def training_loss(self, model, batch):
        loss, n = original(self, model, batch), calls["n"]
        calls["n"] += 1
        return loss * float("nan") if n >= first_bad else loss

    monkeypatch.setattr(ClassificationTask, "training_loss", training_loss)


def test_a_non_finite_stop_before_any_checkpoint_says_none_was_written(tiny_recipe, workdir, monkeypatch):
    from mmformer.commands.train import train

    _nan_from(monkeypatch, 0)
    recipe = load_recipe(tiny_recipe, ["trainer.max_epochs=2", "optim.max_nonfinite_steps=3"])
    with pytest.warns(UserWarning), pytest.raises(FloatingPointError) as e:
        train(recipe)
    assert "resume=auto" not in str(e.value)
    assert str(e.value).endswith(
        "No checkpoint of this run was written yet, so there is nothing to resume: start it again once fixed."
    )
    assert not list((workdir / "runs").rglob("*.ckpt"))


def test_a_diverging_run_records_its_failure_in_run_json(tiny_recipe, workdir):
    """A learning rate that overflows the weights for real: the run stops on its non-finite loss, and
    its folder (no checkpoint yet) says why in run.json."""
    from mmformer.commands.train import train

    lr = ["optim.lr=1e38", "optim.warmup_steps=0", "optim.max_nonfinite_steps=1", "trainer.max_epochs=2"]
    with pytest.raises(FloatingPointError) as e:
        train(load_recipe(tiny_recipe, lr))
    (folder,) = (workdir / "runs" / "tiny").iterdir()
    (failure,) = json.loads((folder / "run.json").read_text())["failures"]
    assert failure["error"] == "FloatingPointError: " + str(e.value).splitlines()[0][:480]
    assert failure["step"] >= 1 and not list(folder.rglob("*.ckpt"))


def test_a_non_finite_stop_names_the_last_checkpoint(tiny_recipe, workdir, monkeypatch):
    from mmformer.commands.train import train

    _nan_from(monkeypatch, 4)  # epoch 0 (steps 0-3) is validated and saved at step 4
    recipe = load_recipe(tiny_recipe, ["trainer.max_epochs=2", "optim.max_nonfinite_steps=3"])
    with pytest.warns(UserWarning), pytest.raises(FloatingPointError) as e:
        train(recipe)
    (last,) = (workdir / "runs" / "tiny").glob("*/checkpoints/last.ckpt")
    assert str(e.value).endswith(f"The last checkpoint is {last} (step 4): resume=auto continues from it.")


def test_a_full_disk_when_the_run_folder_is_written_is_named(workdir):
    from types import SimpleNamespace

    from mmformer.training.runs import Run, RunFolder

    mnt = _mount_tmpfs(workdir / "tiny_fs", "size=4k")
    try:
        with pytest.raises(OSError):  # fill it up for real
            (mnt / "filler").write_bytes(b"x" * 8192)
        run = Run("tiny", "r1", mnt / "tiny" / "r1", None, "r1")
        with pytest.raises(
            CheckpointError, match=rf"^disk full while writing {run.dir}/recipe\.yaml: 0\.0 MB free on {mnt}$"
        ):
            RunFolder(run, "name: tiny\n" * 100).setup(
                SimpleNamespace(is_global_zero=True, world_size=1), None, "fit"
            )
        assert sorted(p.name for p in run.dir.iterdir()) == []  # no half-written file, no temporary
    finally:
        _unmount(mnt)
