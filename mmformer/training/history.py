"""A run's logged history that survives a kill: after any stop and ``resume=auto``, ``metrics.csv`` and
the W&B run hold what an uninterrupted run would — every row once, steps increasing.

At each checkpoint the loggers' buffers reach disk (the CSV rows; the W&B writer's records, flushed to
the run's ``.wandb`` file) and the checkpoint records the last logged step it covers — plus, for a
checkpoint written inside ``on_train_batch_end``, the row Lightning writes for that step right after
(a run resumed from there never writes it). On resume, what the killed run logged after that step is cut
from ``metrics.csv`` and from the run's earlier offline W&B segments (a ``.wandb`` file is a log of
records, cut at a record boundary), the held row is written, and the new W&B segment's ``_step``
continues from the last kept row (``wandb sync`` of the segments then yields one history).

Online W&B runs stream to the server, where rows already sent cannot be cut here: a resumed online
run's history may show the killed run's last rows beside the repeated ones (W&B's "rewind",
``wandb.init(resume_from=…)``, is the server-side tool for that).
"""

from __future__ import annotations

import csv
import json
import os
import struct
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from .steps import logged_step

KEY = "mmformer_history"  # the checkpoint entry: {"step": int, "row": {key: float} | None}


class ResumableHistory(L.Callback):
    """Flushes the loggers at every checkpoint and cuts what a killed run logged after its checkpoint
    when the run resumes (module docstring). Rank 0 edits the files; every rank records the same step."""

    def __init__(self):
        self._in_batch_end = False
        self._resumed: dict | None = None

    # ------------------------------------------------------------------ at a checkpoint
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._in_batch_end = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._in_batch_end = True  # a checkpoint written now precedes this step's row (Checkpoint
        # callbacks run after the others)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._in_batch_end = False

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._in_batch_end = False

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        row = held_row(trainer) if self._in_batch_end else None
        checkpoint[KEY] = {"step": logged_step(trainer), "row": row}
        if trainer.is_global_zero:
            for lg in trainer.loggers:
                flush(lg)

    # ------------------------------------------------------------------ on resume
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._resumed = checkpoint.get(KEY)

    def on_train_start(self, trainer, pl_module) -> None:
        state, self._resumed = self._resumed, None
        if state is None or not trainer.is_global_zero:
            return
        step, row = int(state["step"]), state.get("row")
        last_kept = step - 1 if row else step  # the held row is written again below
        for lg in trainer.loggers:
            if isinstance(lg, CSVLogger):
                cut_csv(Path(lg.log_dir) / "metrics.csv", last_kept)
            elif isinstance(lg, WandbLogger) and lg.experiment.settings.mode == "offline":
                current = Path(lg.experiment.dir).parent
                kept = cut_wandb_segments(current, lg.experiment.id, last_kept)
                if hasattr(lg, "continue_at"):
                    lg.continue_at(kept)
        if row:
            for lg in trainer.loggers:
                lg.log_metrics(row, step=step)
                lg.save()


def held_row(trainer) -> dict[str, float] | None:
    """The row Lightning writes for the current step after ``on_train_batch_end`` (what its logger
    connector logs from ``update_train_step_metrics``), or None when it writes none this step."""
    connector = trainer._logger_connector
    if trainer.fit_loop._should_accumulate() or not connector.should_update_logs:
        return None
    row = {k: float(v) for k, v in connector.metrics["log"].items()}
    return row | {"epoch": float(trainer.current_epoch)} if row else None


def flush(logger) -> None:
    """Write what ``logger`` holds to its files: the CSV rows; for W&B, wait until its writer received
    every record, then one flush interval of its transaction log (``x_transaction_log_flush_interval``,
    set short by ``loggers.build_loggers``); other loggers' ``save``."""
    if isinstance(logger, CSVLogger):
        logger.save()
    elif isinstance(logger, WandbLogger) and logger._experiment is not None:
        run = logger._experiment
        interface = getattr(run, "_interface", None)
        if interface is None:  # a disabled or finished run
            return
        interface.deliver_poll_exit().wait_or(timeout=30)  # answered after the writer saw every record
        time.sleep(1.5 * float(run.settings.x_transaction_log_flush_interval or 0.0))
    else:  # TensorBoard's event writer; MLflow logs synchronously (nothing held)
        logger.save()


def cut_csv(path: Path, last_step: int) -> None:
    """Keep the rows of ``metrics.csv`` whose ``step`` is at most ``last_step`` (header unchanged)."""
    if not path.is_file():
        return
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        rows = list(reader)
    if header is None or "step" not in header:
        return
    at = header.index("step")
    kept = [r for r in rows if r[at] == "" or int(float(r[at])) <= last_step]
    if len(kept) == len(rows):
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", newline="") as f:
        csv.writer(f).writerows([header, *kept])
    os.replace(tmp, path)


# ---------------------------------------------------------------------- W&B offline files
BLOCK, HEADER = 32 * 1024, 7  # the .wandb file: LevelDB-style log, 32 KiB blocks of chunks


def wandb_records(data: bytes):
    """``(offset, record)`` for each whole record of a ``.wandb`` file's bytes (offset: where its first
    chunk starts); a record cut off at the end is not yielded."""
    from wandb.proto import wandb_internal_pb2

    pos, pending, start = HEADER, b"", None
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        if pos + HEADER + length > len(data):
            return
        if kind in (1, 2):
            pending, start = b"", pos
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield start, record


def history_step(record) -> int | None:
    """``trainer/global_step`` of a history record (None for other records or rows without one)."""
    if record.WhichOneof("record_type") != "history":
        return None
    for item in record.history.item:
        if (item.key or "/".join(item.nested_key)) == "trainer/global_step":
            return int(json.loads(item.value_json))
    return None


def cut_wandb_segments(current: Path, run_id: str, last_step: int) -> int:
    """Cut every earlier offline segment of W&B run ``run_id`` (``offline-run-*-<id>`` folders beside
    ``current``) before its first history row past ``last_step``; returns the ``_step`` the next row
    takes (one past the last kept row's)."""
    next_step = 0
    for folder in sorted(current.parent.glob(f"offline-run-*-{run_id}")):
        if folder == current:
            continue
        for path in folder.glob("*.wandb"):
            data = path.read_bytes()
            cut = None
            for offset, record in wandb_records(data):
                step = history_step(record)
                if step is not None and step > last_step:
                    cut = offset
                    break
                if record.WhichOneof("record_type") == "history":
                    next_step = max(next_step, record.history.step.num + 1)
            if cut is not None:
                with open(path, "r+b") as f:
                    f.truncate(cut)
    return next_step
