"""Callbacks: throughput (samples/s through Lightning's ``Throughput``), unreadable-sample report, the
tasks' media (text / audio / image samples) for W&B, and the EMA of the weights."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.loggers import WandbLogger
from torchvision.transforms.functional import to_pil_image
from torchvision.utils import save_image

from ..models.flops import FlopMeter
from .media import Audio, Image, Media, MediaContext, sharded
from .sharded_ema import ShardedEMAWeights, warmed_up_decay
from .steps import logged_step

log = logging.getLogger("mmformer")


def _text_tokens(task_batch: dict) -> int:
    """Real text tokens of one task's batch (0 without text)."""
    return int(task_batch["text_valid"].sum()) if "text_valid" in task_batch else 0


def _skip_media(trainer, pl_module) -> bool:
    """Media run the model on rank 0 alone, except under FSDP2, where every rank must take part in each
    block's all-gather: there all ranks run it (same inputs, same seeds, so the same number of forwards)
    and rank 0 alone writes and logs. None during the sanity check."""
    return trainer.sanity_checking or not (trainer.is_global_zero or sharded(pl_module))


class _Rate:
    """Cumulative time / samples / real text tokens / FLOPs of one group of steps, with Lightning's
    sliding-window ``Throughput`` over them: one meter for samples (and FLOPs, and MFU when the device's
    peak is known), one for tokens that advances only on steps that carried text (its windows still
    span the steps without, so it is tokens per second of wall time)."""

    def __init__(self, window: int, world_size: int, available_flops: float | None = None):
        self.samples_meter = Throughput(available_flops, world_size=world_size, window_size=window)
        self.tokens_meter = Throughput(window_size=window, world_size=world_size)
        self.time, self.batches, self.samples, self.tokens, self.text_batches = 0.0, 0, 0, 0, 0

    def update(self, seconds: float, samples: int, tokens: int, flops: int | None = None) -> dict[str, float]:
        """Per-device ``samples_per_sec``, ``tokens_per_sec``, ``flops_per_sec`` and ``mfu`` once the window
        is full (samples: 2 points)."""
        self.time, self.batches, self.samples = self.time + seconds, self.batches + 1, self.samples + samples
        self.samples_meter.update(time=self.time, batches=self.batches, samples=self.samples, flops=flops)
        out = {}
        computed = self.samples_meter.compute()
        for key in ("samples_per_sec", "flops_per_sec", "mfu"):
            if f"device/{key}" in computed:
                out[key] = float(computed[f"device/{key}"])
        if tokens:
            self.tokens, self.text_batches = self.tokens + tokens, self.text_batches + 1
            self.tokens_meter.update(time=self.time, batches=self.text_batches, samples=self.tokens)
        if self.text_batches:
            rate = self.tokens_meter.compute().get("device/samples_per_sec")
            if rate is not None:
                out["tokens_per_sec"] = float(rate)
        return out


_PRECISION_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32, "64": torch.float64}


def peak_memory_gb(device: torch.device) -> float:
    """The most memory this process has held: allocated on a CUDA device, resident (RSS) on the host."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


class ThroughputLogger(L.Callback):
    """Logs, over a sliding window of training steps (by default as long as the logging interval, 2–20):

    - ``throughput/samples_per_sec`` and ``tokens_per_sec`` (real text tokens) of all ranks together, and
      ``throughput/device/samples_per_sec``;
    - ``throughput/device/tflops`` — model FLOPs per second per device: 3 × the forward FLOPs counted
      analytically as the step runs (``models.flops.FlopMeter``: matmuls and attention; activation
      recomputation is not counted, as MFU's definition asks, Chowdhery et al. 2022, App. B);
    - ``throughput/mfu`` — that over the device's peak for the run's precision (Lightning's table of
      GPUs; not logged where the peak is unknown, e.g. on CPU);
    - ``throughput/data_wait`` — the fraction of wall time between the end of a step and the start of the
      next (fetching and moving the batch: the data pipeline's share when it is the bottleneck);
    - ``memory/peak_gb`` — peak allocated GPU memory (peak resident memory on CPU).

    With several tasks it also logs ``throughput/<task>/samples_per_sec`` (and ``tokens_per_sec``,
    ``device/tflops`` and ``mfu`` for steps holding that task alone) and
    ``throughput/modality/<modality>/samples_per_sec``: the rate over the wall time of the steps that
    held that task (or modality), counted as if every rank ran it — under ``multitask.schedule: sampled``
    the speed of each task alone, under ``all`` the rate its data is consumed at.

    The meters advance every step; the values are logged on the steps whose row the loggers write (every
    ``trainer.log_every_n_steps``), so the progress bar shows them as of the last written row.
    """

    def __init__(self, window_size: int | None = None):
        self.window_size = window_size

    def on_train_start(self, trainer, pl_module) -> None:
        from lightning.fabric.utilities.throughput import get_available_flops

        self.window = self.window_size or min(20, max(2, trainer.log_every_n_steps))
        self.world = trainer.world_size
        self.rates: dict[str, _Rate] = {}
        self.t_prev = time.perf_counter()
        self.waits: list[tuple[float, float]] = []  # (waiting, step) seconds of the last steps
        self.several = len(getattr(pl_module, "tasks", {})) > 1
        self.modalities = dict(getattr(pl_module, "task_modalities", {}))
        self.meter = FlopMeter(pl_module.model) if hasattr(pl_module, "model") else None
        dtype = _PRECISION_DTYPES.get(str(trainer.precision).split("-")[0], torch.float32)
        self.available = None
        if pl_module.device.type == "cuda":
            self.available = get_available_flops(pl_module.device, dtype)

    def on_train_end(self, trainer, pl_module) -> None:
        if getattr(self, "meter", None) is not None:
            self.meter.close()

    def _log(self, pl_module, key: str, rates: dict[str, float], prog_bar: bool) -> None:
        prefix = key
        if "samples_per_sec" in rates:
            if key == "":
                pl_module.log("throughput/device/samples_per_sec", rates["samples_per_sec"])
            pl_module.log(
                f"throughput/{prefix}samples_per_sec",
                rates["samples_per_sec"] * self.world,
                prog_bar=prog_bar,
            )
        if "tokens_per_sec" in rates:
            pl_module.log(f"throughput/{prefix}tokens_per_sec", rates["tokens_per_sec"] * self.world)
        if "flops_per_sec" in rates:
            pl_module.log(
                f"throughput/{prefix}device/tflops", rates["flops_per_sec"] / 1e12, prog_bar=prog_bar
            )
        if "mfu" in rates:
            pl_module.log(f"throughput/{prefix}mfu", rates["mfu"], prog_bar=prog_bar)

    def on_validation_end(self, trainer, pl_module) -> None:
        self.t_prev = time.perf_counter()  # validation time is not training time

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.t_start = time.perf_counter()
        if self.meter is not None:
            self.meter.take()  # forwards outside training steps (validation, samples) are not counted

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        seconds, self.t_prev, wait = now - self.t_prev, now, self.t_start - self.t_prev
        self.waits = [*self.waits[-(self.window - 1) :], (max(wait, 0.0), seconds)]
        flops = 3 * self.meter.take() if self.meter is not None else None
        groups: dict[str, list] = {"": [0, 0, flops]}
        present = [n for n, b in (batch or {}).items() if b is not None and n in pl_module.tasks]
        for name in present:
            task_batch = batch[name]
            samples, tokens = pl_module.tasks[name].batch_size(task_batch), _text_tokens(task_batch)
            keys = [""]
            if self.several:
                keys += [f"{name}/", f"modality/{self.modalities.get(name, '?')}/"]
            for key in keys:
                g = groups.setdefault(key, [0, 0, flops if len(present) == 1 else None])
                g[0], g[1] = g[0] + samples, g[1] + tokens
        # the meters advance every step; the values are logged only on the steps whose row Lightning
        # writes (``log_every_n_steps``), as the gradient norm is: ``self.log`` costs more than the meters
        written = trainer._logger_connector.should_update_logs  # (as ``history.held_row`` reads it)
        for key, (samples, tokens, step_flops) in groups.items():
            rate = self.rates.setdefault(key, _Rate(self.window, self.world, self.available))
            rates = rate.update(seconds, samples, tokens, step_flops)
            if written:
                self._log(pl_module, key, rates, prog_bar=key == "")
        if written and len(self.waits) >= 2:
            pl_module.log(
                "throughput/data_wait", sum(w for w, _ in self.waits) / sum(s for _, s in self.waits)
            )
        if trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
            pl_module.log("memory/peak_gb", peak_memory_gb(pl_module.device))


class BadSampleReport(L.Callback):
    """Collects the unreadable samples the datasets skipped (batch key ``bad_samples``): training replaced
    each by the next readable sample, evaluation left it out of every metric (``mmformer.data.bad_samples``).

    Each file is named once per run, by the dataset that meets it first; the paths seen here are marked
    as named in this process, so data-loader workers started afterwards (training workers start afresh
    every epoch) stay silent. At the end of a fit, or of a validation run alone, the number of distinct
    files (over all ranks and epochs) is printed (``data/bad_samples N``) with the first few paths."""

    def __init__(self, show: int = 10):
        self.show = show
        self.paths: dict[str, None] = {}  # all of them, in the order met
        self.replaced: dict[str, None] = {}  # by training
        self.left_out: dict[str, None] = {}  # by evaluation

    def setup(self, trainer, pl_module, stage: str) -> None:
        from ..data.bad_samples import forget_reported

        forget_reported()  # a new run names every file again, once

    def _collect(self, batch, seen: dict[str, None]) -> None:
        from ..data.bad_samples import mark_reported

        for task_batch in (batch or {}).values():
            if isinstance(task_batch, dict) and task_batch.get("bad_samples"):
                paths = task_batch["bad_samples"]
                seen.update(dict.fromkeys(paths))
                self.paths.update(dict.fromkeys(paths))
                mark_reported(paths)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._collect(batch, self.replaced)

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        self._collect(batch, self.left_out)

    @property
    def count(self) -> int:
        return len(self.paths)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._report(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if getattr(getattr(trainer, "state", None), "fn", None) == "validate":  # a validation run alone
            self._report(trainer)

    def _report(self, trainer) -> None:
        groups = [list(self.paths), list(self.replaced), list(self.left_out)]
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, groups)  # every rank takes part: no hang
            groups = [list(dict.fromkeys(p for rank in gathered for p in rank[k])) for k in range(3)]
        paths, replaced, left_out = groups
        if trainer.is_global_zero and paths:
            log.warning(
                "skipped %d unreadable sample(s): training replaced %d by the next readable one, "
                "evaluation left %d out of every metric; first: %s",
                len(paths),
                len(replaced),
                len(left_out),
                ", ".join(paths[: self.show]),
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


class EMAWeights(WeightAveraging):
    """An exponential moving average of the weights (Lightning's ``WeightAveraging``), with the decay
    warmed up as ``min(decay, (1 + n) / (10 + n))`` after ``n`` updates (as diffusers' ``EMAModel`` and
    timm's ``ModelEmaV3`` do) so that short runs do not carry the initial weights: validation, every
    checkpoint's ``state_dict`` and the sample grids use the average.

    Lightning copies the average into the model when training ends, before ``last.ckpt`` is written;
    this keeps the raw weights so that the final checkpoint still resumes from them
    (``current_model_state``)."""

    def __init__(self, decay: float):
        self.decay = decay
        super().__init__(multi_avg_fn=self._update)
        self._raw_state: dict | None = None

    def _update(self, averaged: list, current: list, num_averaged) -> None:
        decay = warmed_up_decay(self.decay, int(num_averaged))
        pairs = [(a, c) for a, c in zip(averaged, current) if a.is_floating_point()]  # not step counters
        if pairs:
            torch._foreach_lerp_([a for a, _ in pairs], [c for _, c in pairs], 1 - decay)

    @property
    def average(self):
        """The averaged LightningModule (None before fit)."""
        return self._average_model.module if self._average_model is not None else None

    def on_train_end(self, trainer, pl_module) -> None:
        self._raw_state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        super().on_train_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._raw_state is not None:  # after training ended: the model now holds the average
            checkpoint["current_model_state"] = self._raw_state


@contextmanager
def _validation_weights(trainer, pl_module):
    """The model with the weights validation used: Lightning swaps the raw weights back before
    ``on_validation_end``, so with ``EMAWeights`` the average's copy of the model, and under FSDP2 with
    ``ShardedEMAWeights`` the model with each rank's averaged shard swapped in around the block."""
    ema = next((c for c in trainer.callbacks if isinstance(c, EMAWeights)), None)
    model = ema.average.model if ema is not None and ema.average is not None else pl_module.model
    shard_ema = next((c for c in trainer.callbacks if isinstance(c, ShardedEMAWeights)), None)
    with shard_ema.averaged(pl_module) if shard_ema is not None else nullcontext():
        yield model


class MediaSamples(L.Callback):
    """After each validation, every task's media (its ``media(ctx)`` hook: text samples, decoded texts,
    audio tables, sample grids), logged to W&B as ``<name>/<task>`` at the step Lightning logs that
    validation's metrics at (``steps.logged_step``: ``trainer/global_step`` agrees); an image is also
    written to the run folder as ``<name>/<task>-step<N>.png``. ``last`` keeps the latest records by
    key for other loggers. Rank 0 alone calls the hooks, except under FSDP2 (``_skip_media``)."""

    def __init__(self):
        self.last: dict[str, Media] = {}

    def on_validation_end(self, trainer, pl_module) -> None:
        if _skip_media(trainer, pl_module):
            return
        for name, task in pl_module.tasks.items():
            ctx = MediaContext(name, trainer, pl_module, lambda: _validation_weights(trainer, pl_module))
            records = task.media(ctx)
            if trainer.is_global_zero:
                for record in records:
                    self._log(trainer, name, record)

    def _log(self, trainer, task: str, record: Media) -> None:
        key, step = f"{record.name}/{task}", logged_step(trainer)  # the step of this validation's metrics
        self.last[key] = record
        if isinstance(record, Image):
            out = Path(trainer.default_root_dir) / record.name / f"{task}-step{step:06d}.png"
            out.parent.mkdir(parents=True, exist_ok=True)
            save_image(record.image, out)
        for lg in trainer.loggers:
            if not isinstance(lg, WandbLogger):
                continue
            if isinstance(record, Image):
                extra = {"caption": [record.caption]} if record.caption else {}  # W&B: a list or nothing
                lg.log_image(key=key, images=[_pil(record.image)], step=step, **extra)
            else:
                rows = [[_wandb_cell(c) for c in row] for row in record.rows]
                lg.log_table(key, columns=record.columns, data=rows, step=step)


def _wandb_cell(cell):
    """A table cell as W&B shows it: a clip plays, an image shows (with its caption), text stays text."""
    if isinstance(cell, (Audio, Image)):
        import wandb  # ~1 s to import: only when a W&B run logs a clip or a picture

        if isinstance(cell, Audio):
            return wandb.Audio(cell.wave.float().cpu().numpy(), sample_rate=cell.sample_rate)
        return wandb.Image(_pil(cell.image), caption=cell.caption)
    return cell


def _pil(image):
    """``(C, H, W)`` float in [0, 1] as a PIL image: ``wandb.Image`` reads a tensor as values in [0, 255]."""
    return to_pil_image(image.detach().float().clamp(0, 1).cpu())
