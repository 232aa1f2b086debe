"""Media a task shows after each validation — tables of generations, playable clips, sample grids — as
plain records: a task's ``media(ctx)`` hook makes them (``mmformer.tasks.base``) and one callback
(``callbacks.MediaSamples``) logs them, without knowing what kind of task made them.

A record's ``name`` is its prefix; it is logged as ``<name>/<task>`` (``samples/corpus``,
``decoded/captions``, ``audio/speech``) at the trainer's global step.

The prediction picture of each task kind (``PREDICTIONS``, drawn by ``mmformer.training.pictures``) is
made here from the tensors a task's hook hands over: ``classification_picture`` (an image or
spectrogram grid, errors first), ``retrieval_picture`` (text queries with their top-k inputs) and
``captions_picture`` (inputs beside reference and generated text).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..tokenizers.audio import LogMel
from . import pictures


@dataclass
class Audio:
    """A playable clip in a table cell: ``wave (S,)`` float in [-1, 1] at ``sample_rate`` Hz."""

    wave: Tensor
    sample_rate: int


@dataclass
class Table:
    """Rows of cells (``str``, numbers, ``Audio``, ``Image``: the input shown beside its text) under
    ``columns``."""

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


# ---------------------------------------------------------------------------------------- predictions
PREDICTIONS = "predictions"  # the record of every prediction picture: <run>/predictions/<task>-step<N>.png
SPECTROGRAM_MELS = 64  # mel bins of the spectrograms pictures show (25 ms windows, 10 ms hop)


def chunked_forward(ctx: MediaContext, fn, *args, size: int = 16) -> Tensor:
    """``ctx.forward(fn, *args)`` over chunks of ``size`` rows of every tensor argument (other arguments
    as given), concatenated along dim 0: memory stays that of one small batch whatever the pool."""
    n = next(a.shape[0] for a in args if torch.is_tensor(a))
    outs = [
        ctx.forward(fn, *(a[i : i + size] if torch.is_tensor(a) else a for a in args))
        for i in range(0, n, size)
    ]
    return torch.cat(outs)


def spread(total: int, k: int) -> list[int]:
    """``min(k, total)`` indices evenly spread over ``range(total)``, first and last included: a held-out
    set sorted by class (image folders are) still shows every class."""
    if k >= total:
        return list(range(total))
    if k <= 1:
        return [0][:k]
    return [round(i * (total - 1) / (k - 1)) for i in range(k)]


def display_image(image: Tensor) -> Tensor:
    """``(C, H, W)`` pixels as shown: ``uint8`` (0–255, as image files give) scaled to [0, 1]; floating
    point (already normalised) stretched from its own min–max to [0, 1]."""
    if image.dtype == torch.uint8:
        return image.float() / 255
    x = image.detach().float()
    return (x - x.min()) / (x.max() - x.min()).clamp_min(1e-8)


def spectrograms(waves: Tensor, valid: Tensor | None, sample_rate: int) -> list[Tensor]:
    """``waves (N, S)`` float at ``sample_rate`` Hz (``valid (N, S)`` bool, True = real sample) → one
    log-mel ``(SPECTROGRAM_MELS, T_i)`` per clip, cut to its real frames (25 ms windows, 10 ms hop)."""
    mel = LogMel(
        sample_rate=sample_rate,
        n_fft=int(0.025 * sample_rate),
        hop_length=int(0.010 * sample_rate),
        n_mels=SPECTROGRAM_MELS,
    )
    waves = waves.detach().float().cpu()
    log_mel, frames = mel(waves, valid.cpu() if valid is not None else None)  # (N, F, T), (N, T)
    return [m[:, : max(1, int(f.sum()))] for m, f in zip(log_mel, frames)]


def as_pictures(inputs: Tensor, valid: Tensor | None = None, sample_rate: int = 16_000) -> list[Tensor]:
    """A batch's inputs as pictures: images ``(N, C, H, W)`` → ``display_image`` each; waves ``(N, S)`` →
    ``spectrograms``. Raises ``ValueError`` for other shapes (text has no picture)."""
    if inputs.dim() == 4:
        return [display_image(x) for x in inputs.cpu()]
    if inputs.dim() == 2 and inputs.is_floating_point():
        return spectrograms(inputs, valid, sample_rate)
    raise ValueError(f"pictures show images (N, C, H, W) or waves (N, S), got {tuple(inputs.shape)}")


def classification_picture(
    inputs: Tensor,
    labels: Tensor,
    logits: Tensor,
    classes: list[str],
    shown: int = 16,
    valid: Tensor | None = None,
    sample_rate: int = 16_000,
) -> Image:
    """A grid of ``shown`` held-out inputs (images, or spectrograms of waves) out of the ``N`` given, the
    misclassified ones first, the most confident mistakes first (``pictures.errors_first``), each titled
    ``true → predicted probability``.

    ``inputs``: ``(N, C, H, W)`` images or ``(N, S)`` waves (``valid (N, S)``); ``labels (N,)`` long;
    ``logits (N, K)``; ``classes``: the ``K`` names. The caption counts the errors among the ``N``."""
    prob, pred = logits.detach().float().softmax(-1).max(-1)  # (N,), (N,)
    labels, pred, prob = labels.cpu(), pred.cpu(), prob.cpu()
    order = pictures.errors_first(labels, pred, prob)[:shown]
    keep = order.tolist()
    pics = as_pictures(inputs[order], valid[order] if valid is not None else None, sample_rate)
    grid = pictures.classification_grid(
        pics,
        [classes[int(labels[i])] for i in keep],
        [classes[int(pred[i])] for i in keep],
        [float(prob[i]) for i in keep],
    )
    wrong = int((labels != pred).sum())
    return Image(PREDICTIONS, grid, f"{wrong} of {len(labels)} held-out samples misclassified (errors first)")


def retrieval_picture(
    queries: list[str],
    inputs: Tensor,
    sim: Tensor,
    match: Tensor,
    k: int = 5,
    valid: Tensor | None = None,
    sample_rate: int = 16_000,
) -> Image:
    """Text queries with their top-``k`` retrieved inputs (images, or spectrograms of waves).

    ``queries``: ``Q`` texts; ``inputs``: the ``N`` candidates, ``(N, C, H, W)`` or ``(N, S)`` waves
    (``valid (N, S)``); ``sim (Q, N)`` float similarities; ``match (Q, N)`` bool, True where an input is
    a query's pair. The caption gives recall@k over the queries shown."""
    k = min(k, sim.shape[1])
    scores, top = sim.detach().float().cpu().topk(k, dim=1)  # (Q, k)
    hits = match.cpu().gather(1, top)  # (Q, k)
    grid = pictures.retrieval_rows(queries, as_pictures(inputs, valid, sample_rate), top, scores, hits)
    found = int(hits.any(1).sum())
    return Image(PREDICTIONS, grid, f"{found} of {len(queries)} queries find their pair in the top {k}")


def input_cells(
    inputs: Tensor, valid: Tensor | None = None, sample_rate: int = 16_000
) -> list[Audio | Image]:
    """A batch's inputs as table cells, shown beside their text: waves ``(N, S)`` (``valid (N, S)`` bool:
    the clip's own samples) → playable ``Audio`` clips cut to their length; images ``(N, C, H, W)`` →
    ``Image`` cells (``display_image``). Raises ``ValueError`` for other shapes (text is its own cell)."""
    if inputs.dim() == 2 and inputs.is_floating_point():
        lengths = valid.sum(-1).tolist() if valid is not None else [inputs.shape[-1]] * len(inputs)
        return [Audio(w[: int(n)].float().cpu(), sample_rate) for w, n in zip(inputs, lengths)]
    return [Image("input", picture) for picture in as_pictures(inputs)]


def captions_picture(
    inputs: Tensor,
    references: list[str],
    generated: list[str],
    valid: Tensor | None = None,
    sample_rate: int = 16_000,
) -> Image:
    """Inputs (images, or spectrograms of waves) beside their reference and generated texts (compared as
    given: pass normalised texts). ``inputs``: ``(n, C, H, W)`` or ``(n, S)`` waves (``valid (n, S)``)."""
    grid = pictures.captioned_rows(as_pictures(inputs, valid, sample_rate), references, generated)
    same = sum(r == g for r, g in zip(references, generated))
    return Image(PREDICTIONS, grid, f"{same} of {len(references)} generated exactly")
