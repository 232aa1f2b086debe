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
    """True when W&B can log online: ``WANDB_API_KEY`` is set or ``~/.netrc`` has ``api.wandb.ai``."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1]
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def resolve_wandb_mode(mode: str) -> str:
    """``auto`` → ``online`` with credentials, else ``offline``; an explicit ``WANDB_MODE`` wins over auto."""
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE")
    if env in ("online", "offline", "disabled"):
        return env
    return "online" if wandb_credentials_present() else "offline"


def build_loggers(cfg, run_dir: Path, run_name: str, wandb_id: str, recipe: dict) -> list:
    """``cfg``: ``LoggerConfig``. Returns ``[CSV, W&B?]``; the recipe is recorded as hyperparameters."""
    loggers: list = [AppendingCSVLogger(run_dir)]
    mode = resolve_wandb_mode(cfg.mode)
    if mode != "disabled":
        os.environ.setdefault("WANDB_SILENT", "true")
        loggers.append(
            WandbLogger(
                name=run_name,
                save_dir=str(run_dir),
                id=wandb_id,
                project=cfg.project,
                entity=cfg.entity,
                group=cfg.group,
                tags=list(cfg.tags),
                mode=mode,
                resume="allow",
            )
        )
    for lg in loggers:
        lg.log_hyperparams(recipe)
    return loggers


def finish_loggers(loggers) -> None:
    """Flush and close the W&B run (Lightning leaves it open), so its files are complete and a next
    run in the same process starts a new W&B run."""
    for lg in loggers:
        if isinstance(lg, WandbLogger) and lg._experiment is not None:
            lg._experiment.finish()
            lg._experiment = None
