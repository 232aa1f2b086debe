"""Run folders: ``runs/<recipe name>/<run id>/`` with ``recipe.yaml``, ``run.json``, ``checkpoints/``,
``metrics.csv`` and ``wandb/`` (DESIGN.md, Runs). The runs root is ``$MMFORMER_RUNS`` (default ``runs``).

Every process of a multi-process run must agree on the run folder. The first process picks the run id
and exports it (``MMFORMER_RUN_ID``, ``MMFORMER_RESUME_PATH``; :func:`exported`, for the length of the
run only) before Lightning launches the others, which inherit the environment; torchrun and SLURM
launches derive it from their job ids.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import secrets
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch

from ..errors import UsageError
from .checkpoint_io import NOT_MMFORMER, CheckpointError, carries_recipe, write_error
from .sharded import is_sharded, read_meta

log = logging.getLogger("mmformer")
# a run's saved recipe (YAML text) → "key: old → new" for each way its model differs from the one to train
ModelChanges = Callable[[str], list[str]]

RUN_ID_ENV, RESUME_ENV = "MMFORMER_RUN_ID", "MMFORMER_RESUME_PATH"


@dataclass
class Run:
    name: str
    run_id: str
    dir: Path
    resume_from: Path | None
    wandb_id: str

    @property
    def checkpoints(self) -> Path:
        return self.dir / "checkpoints"


def runs_root() -> Path:
    return Path(os.environ.get("MMFORMER_RUNS", "runs"))


def _new_run_id() -> str:
    if os.environ.get("SLURM_JOB_ID"):  # one id per job step, the same on every node of the step
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '0')}"
    if os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":  # torchrun's rendezvous id
        return f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}"
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def find_latest_resumable(name: str, model_changes: ModelChanges | None = None) -> Path | None:
    """The newest ``last.ckpt`` among runs of recipe ``name`` (None: there is none, which is said). When
    it is damaged, the newest intact checkpoint of the same run, which is said too. Given
    ``model_changes`` (what differs between a run's recipe, :func:`latest_recipe_yaml`, and the model
    about to train: ``recipe.model_changes``), runs that trained another model (another attention kernel,
    width, tokenizer …) are passed over, which is said: resuming one would train its weights as a
    different model and mix two models in one run's record.

    Raises:
        CheckpointError: that run has no intact checkpoint (the message lists its checkpoints).
    """
    folder = runs_root() / name
    candidates = sorted(folder.glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
    passed_over = []
    while model_changes is not None and candidates:
        saved = latest_recipe_yaml(candidates[-1].parent.parent)
        changes = model_changes(saved) if saved is not None else []
        if not changes:
            break
        passed_over.append(
            f"{candidates.pop().parent.parent.name} ({', '.join(changes[:3])}"
            + (f", {len(changes) - 3} more" if len(changes) > 3 else "")
            + ")"
        )
    if passed_over:
        log.warning(
            f"resume=auto: not resuming {'; '.join(passed_over)}: another model than this recipe's "
            "(resume=PATH continues one anyway)"
        )
    if not candidates:
        return None
    last = candidates[-1]
    problems = {}
    others = sorted(last.parent.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in [last, *(p for p in others if p != last)]:
        problems[path] = checkpoint_problem(path)
        if problems[path] is None:
            if path != last:
                log.warning(
                    f"resume=auto: {last} {problems[last]}; resuming from {path}, the newest intact "
                    f"checkpoint of run {last.parent.parent.name}"
                )
            return path
    listing = "; ".join(f"{p.name} {what}" for p, what in problems.items())
    raise CheckpointError(
        f"resume=auto: no intact checkpoint in {last.parent}: {listing}. Name one with resume=PATH, "
        "or start a new run without resume"
    )


def latest_recipe_yaml(run_dir: Path) -> str | None:
    """The recipe ``run_dir`` last trained with: its newest ``recipe.resume-N.yaml`` (a resume with a
    changed recipe, :class:`RunFolder`), else ``recipe.yaml``; None when it kept neither."""
    resumed = sorted(run_dir.glob("recipe.resume-*.yaml"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    path = resumed[-1] if resumed else run_dir / "recipe.yaml"
    return path.read_text() if path.is_file() else None


def checkpoint_problem(path: Path) -> str | None:
    """What keeps ``path`` from being resumed ("is truncated (…)", "is not an mmformer training
    checkpoint …"), or None for an intact mmformer checkpoint. Cheap: a file's tensors are mapped, not read."""
    try:
        check_resumable(path)
    except CheckpointError as e:
        return str(e).removeprefix(f"{path} ")
    return None


def check_resumable(path: Path) -> None:
    """Raises ``CheckpointError`` naming ``path`` unless it is an intact mmformer training checkpoint
    (a file, or a sharded folder whose ``meta.pt`` reads)."""
    if not carries_recipe(read_meta(path)):
        raise CheckpointError(f"{path} {NOT_MMFORMER}")


def open_run(name: str, resume: str | None, model_changes: ModelChanges | None = None) -> Run:
    """Create (or, for ``resume``, reopen) the run folder and agree on it across processes.

    ``resume``: ``None`` (new run), ``"auto"`` (newest ``last.ckpt`` of this recipe name whose run
    trained the same model, as ``model_changes`` tells, when given; else a new run; a damaged one falls back to the
    newest intact checkpoint of its run) or a checkpoint path (its run folder is reused when it lies
    inside one).

    Raises:
        FileNotFoundError: ``resume`` names a checkpoint that does not exist.
        CheckpointError: the checkpoint to resume is damaged, foreign or unsafe (:func:`checkpoint_problem`).
        UsageError: the run folder cannot be written (a read-only runs folder).
    """
    if os.environ.get(RUN_ID_ENV):  # a child process: the launcher already decided
        run_id = os.environ[RUN_ID_ENV]
        resume_from = Path(os.environ[RESUME_ENV]) if os.environ.get(RESUME_ENV) else None
        run_dir = runs_root() / name / run_id
    else:
        resume_from = None
        if resume == "auto":
            resume_from = find_latest_resumable(name, model_changes)
        elif resume:
            resume_from = Path(resume)
            if not (resume_from.is_file() or is_sharded(resume_from)):
                raise FileNotFoundError(f"resume checkpoint {str(resume_from)!r} does not exist")
            check_resumable(resume_from)
        if resume_from is not None and resume_from.parent.name == "checkpoints":
            run_dir = resume_from.parent.parent
            run_id = run_dir.name
        else:
            run_id = _new_run_id()
            run_dir = runs_root() / name / run_id
        check_writable(run_dir)
        if resume == "auto" and resume_from is None:
            log.warning(f"resume=auto: {_nothing_to_resume(name)}; starting a new run in {run_dir}")
    info = read_run_json(run_dir)
    wandb_id = info.get("wandb_id") or _wandb_id(run_id)
    return Run(name=name, run_id=run_id, dir=run_dir, resume_from=resume_from, wandb_id=wandb_id)


@contextlib.contextmanager
def exported(run: Run) -> Iterator[None]:
    """Export ``run`` (``MMFORMER_RUN_ID``, ``MMFORMER_RESUME_PATH``) to the rank processes Lightning
    launches inside this block, and take it back after: a later run of this process, or a process it
    starts afterwards, must not take the finished run's folder for its own."""
    saved = {v: os.environ.get(v) for v in (RUN_ID_ENV, RESUME_ENV)}
    os.environ[RUN_ID_ENV] = run.run_id
    if run.resume_from is not None:
        os.environ[RESUME_ENV] = str(run.resume_from.resolve())
    else:
        os.environ.pop(RESUME_ENV, None)
    try:
        yield
    finally:
        for var, value in saved.items():
            os.environ.pop(var, None) if value is None else os.environ.update({var: value})


def _nothing_to_resume(name: str) -> str:
    """Why ``resume=auto`` found nothing: no ``last.ckpt`` under the recipe's runs, and what is there
    instead (another checkpoint to name with ``resume=PATH``; a temporary file a killed save left)."""
    folder = runs_root() / name
    if any(folder.glob("*/checkpoints/last.ckpt")):  # passed over: their models differ (said before)
        return f"no run of recipe {name!r} under {folder} trained this recipe's model"
    found = sorted(folder.glob("*/checkpoints/*.ckpt"), key=lambda p: p.stat().st_mtime)
    unfinished = sorted(folder.glob("*/checkpoints/.*.tmp"))
    notes = [f"resume={found[-1]} continues from the newest checkpoint there"] if found else []
    notes += [f"an unfinished save left {p}" for p in unfinished[-1:]]
    extra = f" ({'; '.join(notes)})" if notes else ""
    return f"no last.ckpt of recipe {name!r} under {folder}{extra}"


def check_writable(run_dir: Path) -> None:
    """Raises ``UsageError`` naming the folder when ``run_dir/checkpoints`` cannot be created or written
    (a read-only runs folder or file system)."""
    target = run_dir / "checkpoints"
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "runs folder" if existing.resolve() == runs_root().resolve() else "folder"
        raise UsageError(
            f"{what} {existing} is read-only: cannot write the run folder {run_dir} "
            "(set MMFORMER_RUNS to a writable folder)"
        )


def _wandb_id(run_id: str) -> str:
    # Deterministic, so every process derives the same id; W&B ids allow [A-Za-z0-9_-].
    return run_id.replace(".", "-")


def read_run_json(run_dir: Path) -> dict:
    path = run_dir / "run.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def git_commit() -> str | None:
    """The commit of the folder the run was started from (the user's project), None outside a git
    checkout; mmformer's own commit is :func:`mmformer_source`'s."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def mmformer_source() -> dict:
    """The mmformer that runs: ``mmformer_version`` (the installed distribution's, else
    ``mmformer.__version__``), ``mmformer_commit`` (the commit of the git checkout the package is imported
    from; None for an installed wheel, or a package folder that checkout does not track) and
    ``mmformer_dirty`` (that checkout has changes, untracked files included; None without a commit)."""
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__

    try:
        found = version("mmformer")
    except PackageNotFoundError:
        found = __version__
    package = Path(__file__).resolve().parents[1]
    commit = _git(package, "rev-parse", "--verify", "-q", "HEAD")
    if commit and not _git(package, "ls-files", "--", "__init__.py"):  # a wheel inside someone's checkout
        commit = None
    dirty = None if commit is None else bool(_git(package, "status", "--porcelain"))
    return {"mmformer_version": found, "mmformer_commit": commit, "mmformer_dirty": dirty}


def _git(folder: Path, *args: str) -> str | None:
    """``git -C folder args…``'s output, stripped; None when git fails or is missing."""
    try:
        out = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _flat_recipe(text: str) -> dict:
    """``{"a.b.c": leaf}`` of a recipe's YAML."""
    import yaml

    def flat(d, prefix=""):
        out = {}
        for k, v in (d or {}).items():
            key = f"{prefix}{k}"
            out.update(flat(v, key + ".") if isinstance(v, dict) else {key: v})
        return out

    return flat(yaml.safe_load(text))


def recipe_changes(old_yaml: str, new_yaml: str) -> list[str]:
    """``key: old → new`` lines for the leaves that differ between two recipes (``resume`` ignored)."""
    a, b = _flat_recipe(old_yaml), _flat_recipe(new_yaml)
    return [
        f"{k}: {a.get(k)!r} → {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if k != "resume" and a.get(k) != b.get(k)
    ]


def describe_resume(run: Run, recipe_yaml: str, ckpt: dict) -> str:
    """What is being resumed: run, checkpoint (``ckpt``, already loaded), its step, and how the recipe
    differs from the run's."""
    lines = [
        f"resuming run {run.run_id} from {run.resume_from} "
        f"(epoch {ckpt.get('epoch', '?')}, global step {ckpt.get('global_step', '?')})"
    ]
    first = run.dir / "recipe.yaml"
    if first.is_file():
        changes = recipe_changes(first.read_text(), recipe_yaml)
        if changes:
            lines.append("note: the recipe differs from the one this run started with:")
            lines += [f"  {c}" for c in changes]
    return "\n".join(lines)


class RunFolder(L.Callback):
    """Writes ``recipe.yaml`` and ``run.json`` from the global-zero process when training starts.
    On resume ``run.json`` keeps its run and W&B ids and gains a resume record, and ``recipe.yaml``
    keeps the recipe the run started with (a changed recipe is saved beside it as ``recipe.resume-N.yaml``).
    A run that stops on an error records it in ``run.json``'s ``failures`` (time, step, the error's
    first line), so a folder without checkpoints says why; a stop on a signal or Ctrl-C is not a failure."""

    def __init__(self, run: Run, recipe_yaml: str):
        self.run, self.recipe_yaml = run, recipe_yaml

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Raises ``CheckpointError`` naming the file that cannot be written (a full disk)."""
        if stage != "fit" or not trainer.is_global_zero:  # not again for the closing validation
            return
        try:
            self.run.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            _raise_write_error(e, self.run.dir)
        info = read_run_json(self.run.dir)
        first = self.run.dir / "recipe.yaml"
        if not first.is_file():
            _write_file(first, self.recipe_yaml)
        elif recipe_changes(first.read_text(), self.recipe_yaml):
            n = len(info.get("resumes", [])) + 1
            _write_file(self.run.dir / f"recipe.resume-{n}.yaml", self.recipe_yaml)
        now = dt.datetime.now().isoformat(timespec="seconds")
        source = mmformer_source()
        if not info:
            info = {
                "run_id": self.run.run_id,
                "wandb_id": self.run.wandb_id,
                "recipe": self.run.name,
                "git_commit": git_commit(),
                **source,
                "start_time": now,
                "world_size": trainer.world_size,
                "threads": torch.get_num_threads(),  # per process (mmformer.training.threads)
                "resumes": [],
            }
        if self.run.resume_from is not None:
            resume = {
                "time": now,
                "from": str(self.run.resume_from),
                "threads": torch.get_num_threads(),
                **source,
            }
            info.setdefault("resumes", []).append(resume)
        _write_file(self.run.dir / "run.json", json.dumps(info, indent=2) + "\n")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        from .preemption import Preempted

        path = self.run.dir / "run.json"
        if (
            not trainer.is_global_zero
            or not path.is_file()
            or isinstance(exception, (Preempted, KeyboardInterrupt))
        ):
            return
        info = read_run_json(self.run.dir)
        lines = str(exception).strip().splitlines() or [""]
        failure = {
            "time": dt.datetime.now().isoformat(timespec="seconds"),
            "step": trainer.global_step,
            "error": f"{type(exception).__name__}: {lines[0]}"[:500],
        }
        info.setdefault("failures", []).append(failure)
        try:
            _write_file(path, json.dumps(info, indent=2) + "\n")
        except Exception as e:  # never hides the error being raised (a full disk, say)
            log.warning(f"could not record the failure in {path}: {e}")


def _write_file(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it). Raises ``CheckpointError``
    naming ``path`` when it cannot be written (a full disk); the temporary file is removed."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        _raise_write_error(e, path)


def _raise_write_error(e: OSError, path: Path) -> None:
    error = write_error(e, path)
    if error is None:
        raise e
    raise error from e
