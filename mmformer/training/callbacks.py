"""Callbacks: throughput (samples/s through Lightning's ``Throughput``), unreadable-sample report."""

from __future__ import annotations

import logging
import time

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput

log = logging.getLogger("mmformer")


def _batch_samples(batch: dict) -> int:
    n = 0
    for task_batch in batch.values():
        if task_batch is None:
            continue
        first = next(v for v in task_batch.values() if isinstance(v, torch.Tensor))
        n += first.shape[0]
    return n


class ThroughputLogger(L.Callback):
    """Logs ``throughput/samples_per_sec`` (all ranks together) and ``throughput/device/samples_per_sec``
    over a sliding window of training batches (by default as long as the logging interval, 2–20)."""

    def __init__(self, window_size: int | None = None):
        self.window_size = window_size

    def on_train_start(self, trainer, pl_module) -> None:
        window = self.window_size or min(20, max(2, trainer.log_every_n_steps))
        self.meter = Throughput(window_size=window, world_size=trainer.world_size)
        self.t0, self.samples, self.batches = time.perf_counter(), 0, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.samples += _batch_samples(batch)
        self.batches += 1
        self.meter.update(time=time.perf_counter() - self.t0, batches=self.batches, samples=self.samples)
        metrics = self.meter.compute()
        if "device/samples_per_sec" in metrics:
            device = float(metrics["device/samples_per_sec"])
            pl_module.log("throughput/device/samples_per_sec", device)
            pl_module.log("throughput/samples_per_sec", device * trainer.world_size, prog_bar=True)


class BadSampleReport(L.Callback):
    """Collects the paths of unreadable samples that datasets skipped (batch key ``bad_samples``) and
    prints the number of distinct files (over all ranks and epochs) and the first few paths at the end."""

    def __init__(self, show: int = 10):
        self.show = show
        self.paths: dict[str, None] = {}

    def _collect(self, batch) -> None:
        for task_batch in (batch or {}).values():
            if isinstance(task_batch, dict):
                for p in task_batch.get("bad_samples", []):
                    self.paths[p] = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._collect(batch)

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        self._collect(batch)

    @property
    def count(self) -> int:
        return len(self.paths)

    def on_fit_end(self, trainer, pl_module) -> None:
        paths = list(self.paths)
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, paths)  # every rank takes part: no hang
            paths = list(dict.fromkeys(p for rank_paths in gathered for p in rank_paths))
        if trainer.is_global_zero and paths:
            log.warning(
                "skipped %d unreadable sample(s); first: %s", len(paths), ", ".join(paths[: self.show])
            )
            print(f"data/bad_samples {len(paths)}")


class LastValidationStep(L.Callback):
    """Remembers the global step of the last real (not sanity-check) validation, so the CLI can tell
    whether the final weights were already validated."""

    def __init__(self):
        self.step = -1

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.step = trainer.global_step
