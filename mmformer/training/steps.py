"""The step a logged value belongs to, as Lightning's loggers record it, and step-only values that
belong to one step alone.

Lightning writes every logged value with ``step = fit_loop.epoch_loop._batches_that_stepped``: the
number of optimizer steps *before* the current one — a training step's row and the validation that
follows it share that number (the loop counts the step only after its validation). Everything mmformer
logs outside ``self.log`` (media tables, sample grids, the PNG file names) uses the same number, so a
validation's metrics and its media line up in every logger (``LearningRateMonitor`` reads the same
counter). Lightning 2.6 keeps it in that protected attribute; the tests reading ``metrics.csv`` and the
W&B records back check the agreement.
"""

from __future__ import annotations


def logged_step(trainer) -> int:
    """The ``step`` Lightning's loggers give a value logged now (``trainer/global_step`` in W&B, the
    ``step`` column of ``metrics.csv``): during fit one less than ``trainer.global_step`` after an
    optimizer step; in a standalone ``validate`` the checkpoint's count."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def forget_step_values(trainer) -> None:
    """Drop the previous optimizer step's step-only values (``self.log(..., on_step=True,
    on_epoch=False)``) from the row the next step writes.

    Lightning keeps each value's last ``forward`` result for the whole epoch and writes it in every later
    row until it is logged again, so a value logged on some steps only — a task that a sampled schedule
    did not pick, the gradient norm of an update skipped for a non-finite loss — would repeat its old
    number under steps it did not happen on. Marking the result as reset hides it until it is next
    logged (``_ResultCollection.valid_items`` skips reset results; ``update_metrics`` clears the mark).
    Values that also aggregate over the epoch (``on_epoch=True``) are left alone. Call at the start of
    each optimizer step's first micro-batch."""
    results = getattr(trainer, "_results", None)
    if results is None:
        return
    for metric in results.values():
        meta = getattr(metric, "meta", None)
        if meta is not None and meta.on_step and not meta.on_epoch:
            metric.has_reset = True
