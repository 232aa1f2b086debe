"""Checkpoint writing: atomic writes (a temporary file in the same folder, fsync, rename over the
target: a run killed mid-save leaves the previous ``last.ckpt`` intact, never a truncated one),
``weights_only`` loading, and the always-fresh ``last.ckpt``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a process killed mid-save
            if stale != tmp:
                stale.unlink(missing_ok=True)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = True) -> dict[str, Any]:
        # Checkpoints hold only tensors and plain containers: never unpickle arbitrary objects.
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


class LastCheckpoint(ModelCheckpoint):
    """Keeps ``last.ckpt`` = the newest state whatever the monitored metric did: written after every
    validation (with ``every_n_train_steps``: every N optimizer steps instead) and when training ends.

    Lightning 2.6's ``save_last=True`` rewrites ``last.ckpt`` only on steps where a top-k checkpoint
    was saved, which would make ``resume=auto`` restart from a stale state.
    """

    def __init__(self, dirpath: str, every_n_train_steps: int | None = None):
        super().__init__(
            dirpath=dirpath,
            filename="last",
            monitor=None,
            save_top_k=1,
            save_last=False,
            enable_version_counter=False,
            every_n_train_steps=every_n_train_steps,
        )

    @property
    def state_key(self) -> str:
        return "LastCheckpoint"

    def on_train_end(self, trainer, pl_module) -> None:
        if self._last_global_step_saved != trainer.global_step and not trainer.sanity_checking:
            self._save_checkpoint(trainer, self.format_checkpoint_name({}))

    def save_now(self, trainer) -> str | None:
        """Write ``last.ckpt`` now unless it already holds this step (every rank calls this at the same
        point: a stop on a signal); returns its path, or None when there is none on disk (a sharded
        checkpoint is a folder)."""
        path = self.format_checkpoint_name({})
        if self._last_global_step_saved != trainer.global_step:
            rank_zero_info(f"saving {path} at step {trainer.global_step}")
            self._save_checkpoint(trainer, path)
        return path if os.path.exists(path) else None
