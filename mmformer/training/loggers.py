"""Loggers: a CSV log that is always on (``metrics.csv`` in the run folder, appended on resume) and
W&B through Lightning's ``WandbLogger`` — online when credentials exist, offline otherwise, or off.

W&B offline runs are written under ``<run folder>/wandb/`` and uploaded later with ``wandb sync``.
On resume the W&B run id from ``run.json`` is reused and the logged ``trainer/global_step`` continues
from the checkpoint's global step.
"""

from __future__ import annotations

import csv
import netrc
import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from ..errors import UsageError


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


def build_loggers(cfg, run_dir: Path, run_name: str, wandb_id: str, recipe: dict) -> list:
    """``cfg``: ``LoggerConfig``. Returns ``[CSV, W&B?]``; the recipe is recorded as hyperparameters.
    Raises ``UsageError`` for W&B online without an API key (``check_wandb_login``)."""
    check_wandb_login(cfg.mode)
    loggers: list = [AppendingCSVLogger(run_dir)]
    mode = resolve_wandb_mode(cfg.mode)
    if mode != "disabled":
        os.environ.setdefault("WANDB_SILENT", "true")
        loggers.append(
            ContinuingWandbLogger(
                name=run_name,
                save_dir=str(run_dir),
                id=wandb_id,
                project=cfg.project,
                entity=cfg.entity,
                group=cfg.group,
                tags=list(cfg.tags),
                mode=mode,
                resume="allow",
                # the .wandb file gets what the writer holds every 0.2 s (W&B's default: 15 s), so a
                # checkpoint's flush (history.flush) waits that long, and a killed run loses at most that
                settings={"x_transaction_log_flush_interval": FLUSH_SECONDS},
            )
        )
    for lg in loggers:
        lg.log_hyperparams(recipe)
    return loggers


FLUSH_SECONDS = 0.2


class ContinuingWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger`` whose next row can be given its W&B ``_step``: a resumed offline
    segment continues the history of the segments before it (``history.ResumableHistory``) instead of
    counting from 0 again, so ``wandb sync`` of every segment yields one increasing history."""

    _continue_at: int | None = None

    def continue_at(self, step: int) -> None:
        """The next logged row takes ``_step = step`` (0: nothing before it, nothing to do)."""
        self._continue_at = step or None

    def log_metrics(self, metrics, step: int | None = None) -> None:
        if self._continue_at is None:
            return super().log_metrics(metrics, step)
        at, self._continue_at = self._continue_at, None
        row = dict(metrics) if step is None else dict(metrics, **{"trainer/global_step": step})
        self.experiment.log(row, step=at, commit=True)


def finish_loggers(loggers) -> None:
    """Flush and close the W&B run (Lightning leaves it open), so its files are complete and a next
    run in the same process starts a new W&B run."""
    for lg in loggers:
        if isinstance(lg, WandbLogger) and lg._experiment is not None:
            lg._experiment.finish()
            lg._experiment = None
