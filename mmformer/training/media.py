"""Media a task shows after each validation — tables of generations, playable clips, sample grids — as
plain records: a task's ``media(ctx)`` hook makes them (``mmformer.tasks.base``) and one callback
(``callbacks.MediaSamples``) logs them, without knowing what kind of task made them.

A record's ``name`` is its prefix; it is logged as ``<name>/<task>`` (``samples/corpus``,
``decoded/captions``, ``audio/speech``) at the trainer's global step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class Audio:
    """A playable clip in a table cell: ``wave (S,)`` float in [-1, 1] at ``sample_rate`` Hz."""

    wave: Tensor
    sample_rate: int


@dataclass
class Table:
    """Rows of cells (``str``, numbers, ``Audio``) under ``columns``."""

    name: str
    columns: list[str]
    rows: list[list[Any]]


@dataclass
class Image:
    """One image (a sample grid), ``(C, H, W)`` float in [0, 1]; written to the run folder as
    ``<name>/<task>-step<N>.png`` and logged with its ``caption`` (None: none)."""

    name: str
    image: Tensor
    caption: str | None = None


Media = Table | Image


def sharded(pl_module) -> bool:
    """True under FSDP2: the weights live in shards on every rank, so rank 0 cannot run the model alone."""
    return getattr(pl_module, "device_mesh", None) is not None


def run_as_forward(pl_module, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in evaluation mode without gradients, run through the LightningModule's
    ``forward`` (under FSDP2 the root unit: tokenizer / head weights are gathered around it); the
    training mode is restored afterwards."""
    was_training = pl_module.training
    pl_module.eval()
    try:
        with torch.no_grad():
            return pl_module(fn, *args, **kwargs)
    finally:
        pl_module.train(was_training)


@dataclass
class MediaContext:
    """What a task's ``media`` hook may use after a validation.

    Attributes:
        task: the task's name in the recipe.
        trainer, module: the Lightning trainer and the ``MultiTaskModule``.
        averaged: returns a context manager that gives the model with the EMA of the weights (None when
            no average is kept); see ``validation_weights``.
    """

    task: str
    trainer: Any
    module: Any
    averaged: Callable[[], AbstractContextManager] | None = None

    def validation_weights(self) -> AbstractContextManager:
        """A context manager giving the model with the weights validation used: the EMA of the weights
        when kept (Lightning has swapped the raw weights back by the end of validation), else ``model``."""
        return self.averaged() if self.averaged is not None else nullcontext(self.model)

    @property
    def model(self):
        """The composed model with the raw (trained) weights."""
        return self.module.model

    @property
    def device(self) -> torch.device:
        return self.module.device

    @property
    def val(self):
        """This task's held-out dataset (per-sample dicts, as its loader reads them)."""
        return self.trainer.datamodule.data[self.task].val

    @property
    def sharded(self) -> bool:
        """FSDP2: every rank runs the task's forwards (each gathers weights from all ranks), so a task
        must run the same number of them on every rank whatever its outputs (no early stop)."""
        return sharded(self.module)

    def forward(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` through the module's forward, in evaluation mode, without gradients."""
        return run_as_forward(self.module, fn, *args, **kwargs)
