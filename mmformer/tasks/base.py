"""What the multi-task router (``MultiTaskModule``) asks of every objective: the ``Task`` protocol, and
``TaskBase``, the ``nn.Module`` every task in this package derives from, with the optional hooks as
no-ops. Batches are dicts of tensors (DESIGN.md, "Batches"); ``model`` is the composed
``MultimodalModel``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor, nn

from ..models.model import MultimodalModel
from ..training.media import Media, MediaContext


@runtime_checkable
class Task(Protocol):
    """An objective on one kind of batch.

    Attributes:
        val_metrics: metric name → torchmetrics metric, updated by ``validation_update`` and logged as
            ``val/<task>/<name>`` (synchronised over ranks at epoch end).
        epoch_metric_names: the names ``epoch_metrics()`` returns (logged as ``val/<task>/<name>`` too).
        main_metric: ``(name, "min" | "max")``, what the best checkpoint monitors by default.
        lockstep: set under FSDP2: decoding runs the same number of forwards on every rank.
    """

    val_metrics: nn.ModuleDict
    epoch_metric_names: tuple[str, ...] | list[str]
    main_metric: tuple[str, str]
    lockstep: bool

    def batch_size(self, batch: dict) -> int:
        """The number of samples in ``batch``."""

    def loss_units(self, batch: dict) -> int:
        """How many terms the training loss averages in ``batch`` (target tokens, samples)."""

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        """The scalar training loss of ``batch``."""

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        """Update ``val_metrics`` with ``batch``."""

    def on_validation_epoch_start(self, model: MultimodalModel) -> None:
        """Before each validation, with the validation weights (reseed noise, embed zero-shot classes)."""

    def epoch_metrics(self) -> dict[str, float]:
        """Whole-set metrics after a validation, the same on every rank."""

    def after_optimizer_step(self) -> None:
        """After each optimizer update (clip a learned temperature)."""

    def media(self, ctx: MediaContext) -> list[Media]:
        """Records to show after a validation (generations, clips, sample grids); under FSDP2 called on
        every rank, which must run the same forwards (only rank 0's records are logged)."""


class TaskBase(nn.Module):
    """The ``Task`` hooks a task need not have: ``loss_units`` = ``batch_size``, no epoch metrics, no
    media, nothing before validation or after an update. Subclasses set ``val_metrics`` and
    ``main_metric`` and define ``batch_size``, ``training_loss`` and ``validation_update``."""

    main_metric: tuple[str, str] = ("loss", "min")
    epoch_metric_names: tuple[str, ...] | list[str] = ()
    lockstep: bool = False

    def batch_size(self, batch: dict) -> int:
        raise NotImplementedError

    def loss_units(self, batch: dict) -> int:
        return self.batch_size(batch)

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        raise NotImplementedError

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        raise NotImplementedError

    def on_validation_epoch_start(self, model: MultimodalModel) -> None:
        pass

    def epoch_metrics(self) -> dict[str, float]:
        return {}

    def after_optimizer_step(self) -> None:
        pass

    def media(self, ctx: MediaContext) -> list[Media]:
        return []
