"""Loggers, through Lightning's own: a CSV log that is always on (``metrics.csv`` in the run folder,
appended on resume) and, as ``logger.kinds`` lists them, W&B (``WandbLogger``: online when credentials
exist, offline otherwise, or off), TensorBoard (``TensorBoardLogger``, event files in
``<run folder>/tensorboard/``) and MLflow (``MLFlowLogger``, by default a file store
``<runs folder>/mlruns`` shared by every run).

W&B offline runs are written under ``<run folder>/wandb/`` and uploaded later with ``wandb sync``
(``wandb_sync_command``: every segment of a resumed run into the one W&B run). On resume the W&B run id
from ``run.json`` is reused and the logged ``trainer/global_step`` continues from the checkpoint's global
step; the MLflow run of the same name is continued.
"""

from __future__ import annotations

import csv
import importlib.util
import netrc
import os
import shlex
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only

from ..errors import UsageError
from .checkpoint_io import LastCheckpoint


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer deletes an existing ``metrics.csv``; this one keeps and extends it."""

    def _check_log_dir_exists(self) -> None:
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = list(next(csv.reader(f), []))


class AppendingCSVLogger(CSVLogger):
    """``CSVLogger`` writing ``<save_dir>/metrics.csv`` directly, appending across resumes."""

    def __init__(self, save_dir: str | Path):
        super().__init__(save_dir=str(save_dir), name="", version="")

    def log_hyperparams(self, params=None) -> None:
        pass  # the run folder's recipe.yaml already holds the resolved recipe

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            os.makedirs(self.log_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


def wandb_credentials_present() -> bool:
    """True when W&B finds an API key for ``WANDB_BASE_URL`` where ``wandb.init`` looks: ``WANDB_API_KEY``
    (or ``WANDB_IDENTITY_TOKEN_FILE``), else the netrc file (``$NETRC``, else ``~/.netrc``), read by wandb's
    own reader. A key wandb would refuse counts as none."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        from wandb.sdk.lib.wbauth import read_netrc_auth  # wandb >= 0.22
    except ImportError:  # an older wandb reads ~/.netrc (what Python's netrc reads too)
        try:
            return netrc.netrc().authenticators(_wandb_host().split("://")[-1]) is not None
        except (FileNotFoundError, netrc.NetrcParseError, OSError):
            return False
    try:
        return read_netrc_auth(host=_wandb_host()) is not None
    except Exception:  # wandb.errors.AuthenticationError: a malformed key, which wandb.init refuses too
        return False


def _wandb_host() -> str:
    return os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")


def check_wandb_login(mode: str) -> None:
    """Refuse, before any W&B run starts, to log online without an API key (``wandb.init`` would fail
    with a traceback ending in ``wandb.errors.UsageError``). ``mode``: ``logger.mode``.

    Raises:
        UsageError: W&B logs online (``logger.mode: online``, or ``WANDB_MODE=online`` under ``auto``)
            and no key is found; the message names what is missing and the two ways on.
    """
    if resolve_wandb_mode(mode) != "online" or wandb_credentials_present():
        return
    netrc_file = os.environ.get("NETRC") or "~/.netrc"
    host = _wandb_host().split("://")[-1]
    raise UsageError(
        f"W&B is set to log online but no W&B API key was found (WANDB_API_KEY is unset, no {netrc_file} "
        f"entry for {host}): run `wandb login`, or log offline with logger.mode=offline"
    )


def resolve_wandb_mode(mode: str) -> str:
    """``auto`` → ``online`` with credentials, else ``offline``; an explicit ``WANDB_MODE`` wins over auto."""
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE")
    if env in ("online", "offline", "disabled"):
        return env
    return "online" if wandb_credentials_present() else "offline"


# logger.kinds → the Python package it needs and what installs it (TensorBoard is a dependency of
# mmformer; MLflow comes with the ``loggers`` extra of pyproject.toml)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "'mmformer[loggers]'")}


def check_loggers(cfg) -> None:
    """Refuse, before any data is read, loggers that cannot start. ``cfg``: ``LoggerConfig``.

    Raises:
        UsageError: a ``logger.kinds`` entry whose package is not installed (the message names the
            ``pip install`` that brings it), or W&B online without an API key (``check_wandb_login``).
    """
    for kind in cfg.kinds:
        package, install = PACKAGES.get(kind, (None, None))
        if package is not None and importlib.util.find_spec(package) is None:
            rest = ", ".join(k for k in cfg.kinds if k != kind)
            raise UsageError(
                f"logger.kinds has {kind!r} but the {package} package is not installed: "
                f"pip install {install} (or leave it out: logger.kinds=[{rest}])"
            )
    if "wandb" in cfg.kinds:
        check_wandb_login(cfg.mode)


def build_loggers(cfg, run_dir: Path, run_name: str, wandb_id: str, recipe: dict) -> list:
    """``cfg``: ``LoggerConfig``. Returns ``[CSV, *the loggers of logger.kinds]``; the resolved recipe is
    recorded as their hyperparameters (MLflow parameters; W&B config).

    Raises:
        UsageError: as ``check_loggers``.
    """
    check_loggers(cfg)
    loggers: list = [AppendingCSVLogger(run_dir)]
    for kind in cfg.kinds:
        if kind == "wandb" and resolve_wandb_mode(cfg.mode) != "disabled":
            loggers.append(_wandb_logger(cfg, run_dir, run_name, wandb_id))
        elif kind == "tensorboard":
            loggers.append(
                TensorBoardLogger(
                    save_dir=str(run_dir), name="tensorboard", version="", default_hp_metric=False
                )
            )
        elif kind == "mlflow":
            loggers.append(_mlflow_logger(cfg, run_dir, run_name))
    for lg in loggers:
        lg.log_hyperparams(recipe)
    return loggers


def _wandb_logger(cfg, run_dir: Path, run_name: str, wandb_id: str) -> ContinuingWandbLogger:
    os.environ.setdefault("WANDB_SILENT", "true")  # mmformer prints the run's URL or sync command itself
    return ContinuingWandbLogger(
        name=run_name,
        save_dir=str(run_dir),
        id=wandb_id,
        project=cfg.project,
        entity=cfg.entity,
        group=cfg.group,
        tags=list(cfg.tags),
        mode=resolve_wandb_mode(cfg.mode),
        resume="allow",
        log_checkpoints=cfg.log_model,
        # the .wandb file gets what the writer holds every 0.2 s (W&B's default: 15 s), so a
        # checkpoint's flush (history.flush) waits that long, and a killed run loses at most that
        settings={"x_transaction_log_flush_interval": FLUSH_SECONDS},
    )


def _mlflow_logger(cfg, run_dir: Path, run_name: str) -> ContinuingMLFlowLogger:
    uri = cfg.mlflow_tracking_uri or (Path(run_dir).resolve().parent.parent / "mlruns").as_uri()
    if uri.startswith("file:"):
        # MLflow 3 refuses its file store unless asked for it; it is what needs no server or database
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    run_id = _mlflow_run_named(uri, cfg.project, run_name) if rank_zero_only.rank == 0 else None
    tags = {"mmformer.run": run_name, **({"mmformer.group": cfg.group} if cfg.group else {})}
    tags |= {tag: "" for tag in cfg.tags}
    return ContinuingMLFlowLogger(
        experiment_name=cfg.project, run_name=run_name, tracking_uri=uri, run_id=run_id, tags=tags
    )


def _mlflow_run_named(uri: str, experiment: str, run_name: str) -> str | None:
    """The id of the MLflow run called ``run_name`` (a resumed run's earlier segments), set running
    again; None when there is none. Creates the experiment when missing (Lightning would, with a warning)."""
    from mlflow.tracking import MlflowClient  # an optional extra: imported only when logger.kinds has it

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        client.create_experiment(experiment)
        return None
    runs = client.search_runs(
        [found.experiment_id], filter_string=f"tags.`mlflow.runName` = '{run_name}'", max_results=1
    )
    if not runs:
        return None
    client.update_run(runs[0].info.run_id, status="RUNNING")
    return runs[0].info.run_id


class ContinuingMLFlowLogger(MLFlowLogger):
    """Lightning's ``MLFlowLogger`` that can continue an earlier run (``run_id``): MLflow refuses to change
    a parameter, so a resumed run adds only the recipe keys the run does not hold yet (the changed
    ones are in ``run.json``'s resumes and the printed resume summary)."""

    @rank_zero_only
    def log_hyperparams(self, params) -> None:
        held = self.experiment.get_run(self.run_id).data.params
        super().log_hyperparams({k: v for k, v in _flat(params).items() if k not in held})


def _flat(params: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` → ``{"a/b": 1}`` (Lightning's key delimiter for hyperparameters)."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict) and value:
            out |= _flat(value, f"{prefix}{key}/")
        else:
            out[f"{prefix}{key}"] = value
    return out


FLUSH_SECONDS = 0.2


class ContinuingWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger`` whose next row can be given its W&B ``_step``: a resumed offline
    segment continues the history of the segments before it (``history.ResumableHistory``) instead of
    counting from 0 again, so ``wandb sync`` of every segment yields one increasing history.

    ``log_checkpoints`` (``logger.log_model``) sends checkpoints as versions of the W&B model artifact
    ``model-<run id>`` (file ``model.ckpt``, as ``WandbLogger(log_model=…)`` names them) through the
    logger's own ``after_save_checkpoint`` / ``finalize`` hooks: ``last`` — ``last.ckpt`` at the end of a
    successful fit, alias ``last``; ``best`` — the best checkpoint then, alias ``best``; ``all`` — every
    checkpoint as it is written (``last`` / ``best`` aliases as they apply). W&B adds ``latest`` to the
    newest version. Offline, the artifact waits in the run's ``.wandb`` file for ``wandb sync``.
    ``url``: the run's page once an online run started (None offline or before).
    """

    _continue_at: int | None = None

    def __init__(self, *, log_checkpoints: str = "false", **kwargs):
        super().__init__(**kwargs)
        # Lightning passes wandb.init(anonymous=None), which W&B >= 0.22 answers with "The anonymous
        # setting has no effect…" on every start; leaving the argument out is the same run
        self._wandb_init.pop("anonymous", None)
        self.log_checkpoints = log_checkpoints
        self.url: str | None = None
        self._callbacks: dict[int, object] = {}
        self._sent: dict[str, float] = {}  # checkpoint path → mtime of the version sent

    @property
    def experiment(self):
        run = super().experiment
        if self.url is None and self._experiment is not None and not (run.offline or run.disabled):
            self.url = run.url
        return run

    def continue_at(self, step: int) -> None:
        """The next logged row takes ``_step = step`` (0: nothing before it, nothing to do)."""
        self._continue_at = step or None

    def log_metrics(self, metrics, step: int | None = None) -> None:
        if self._continue_at is None:
            return super().log_metrics(metrics, step)
        at, self._continue_at = self._continue_at, None
        row = dict(metrics) if step is None else dict(metrics, **{"trainer/global_step": step})
        self.experiment.log(row, step=at, commit=True)

    # ------------------------------------------------------------------ checkpoints as artifacts
    def after_save_checkpoint(self, checkpoint_callback) -> None:
        if self.log_checkpoints == "false":
            return
        self._callbacks[id(checkpoint_callback)] = checkpoint_callback
        if self.log_checkpoints == "all":
            self._send(checkpoint_callback)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if status == "success" and self.log_checkpoints in ("last", "best") and self._experiment is not None:
            for callback in self._callbacks.values():
                self._send(callback)

    def _send(self, callback) -> None:
        import wandb  # already imported by WandbLogger's run

        for path, aliases, metadata in _checkpoint_files(callback, self.log_checkpoints):
            mtime = os.path.getmtime(path)
            if self._sent.get(path) == mtime:
                continue
            artifact = wandb.Artifact(name=f"model-{self.experiment.id}", type="model", metadata=metadata)
            artifact.add_file(path, name="model.ckpt", policy="mutable")  # copied: last.ckpt is rewritten
            self.experiment.log_artifact(artifact, aliases=aliases)
            self._sent[path] = mtime


def _checkpoint_files(callback, which: str) -> list[tuple[str, list[str], dict]]:
    """``(path, aliases, metadata)`` of the checkpoint files of ``callback`` that ``which``
    (``logger.log_model``) sends; files that are not there (a sharded folder, a removed top-k) are left out."""
    if isinstance(callback, LastCheckpoint):
        files = [(callback.format_checkpoint_name({}), ["last"], {})] if which in ("last", "all") else []
    else:
        best = callback.best_model_path
        chosen = (
            [best] if which == "best" and best else list(callback.best_k_models) if which == "all" else []
        )
        files = [
            (
                p,
                ["best"] if p == best else [],
                {"monitor": callback.monitor, "score": _number(callback.best_k_models.get(p))},
            )
            for p in chosen
        ]
    return [(p, a, {"original_filename": Path(p).name, **m}) for p, a, m in files if os.path.isfile(p)]


def _number(score) -> float | None:
    return None if score is None else float(score)


def wandb_run_url(loggers) -> str | None:
    """The page of the online W&B run among ``loggers`` (None when there is none)."""
    return next((lg.url for lg in loggers if isinstance(lg, ContinuingWandbLogger) and lg.url), None)


def wandb_sync_command(run_dir: Path, wandb_id: str) -> str | None:
    """One ``wandb sync`` command that uploads every offline segment of the run's W&B run (one folder per
    start and resume, ``<run folder>/wandb/offline-run-<time>-<id>``, named in the order they started)
    into that one W&B run (``--id``); None when the run has no offline segment."""
    folders = sorted((Path(run_dir) / "wandb").glob(f"offline-run-*-{wandb_id}"))
    if not folders:
        return None
    return shlex.join(["wandb", "sync", "--id", wandb_id, *(str(f) for f in folders)])


def finish_loggers(loggers) -> None:
    """Flush and close the W&B run (Lightning leaves it open), so its files are complete and a next
    run in the same process starts a new W&B run."""
    for lg in loggers:
        if isinstance(lg, WandbLogger) and lg._experiment is not None:
            lg._experiment.finish()
            lg._experiment = None
