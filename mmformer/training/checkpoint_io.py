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
from lightning.pytorch.utilities.exceptions import SIGTERMException


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

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # SIGTERM (preemption, scancel, docker stop) may reach one rank, or reach ranks a step apart:
        # agree first (one all-reduce), then every rank saves at this same step and stops after it.
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return  # mid accumulation window: finish it first, or its gradients would be lost
        stop = trainer.received_sigterm
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            trainer._signal_connector.received_sigterm = True  # Lightning stops every rank after this step
            if self._last_global_step_saved != trainer.global_step:
                rank_zero_info(
                    f"SIGTERM at step {trainer.global_step}: saving {self.format_checkpoint_name({})}"
                )
                self._save_checkpoint(trainer, self.format_checkpoint_name({}))

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # SIGTERM outside a training step (during validation): one process can save safely; several
        # might not all be here, so they keep the last agreed checkpoint.
        if (
            isinstance(exception, SIGTERMException)
            and trainer.world_size == 1
            and self._last_global_step_saved != trainer.global_step
        ):
            self._save_checkpoint(trainer, self.format_checkpoint_name({}))
