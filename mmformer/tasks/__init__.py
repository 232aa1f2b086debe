"""Objectives (one module per kind of task) and the LightningModule that routes batches to them."""

from .classification import ClassificationTask
from .router import MultiTaskModule

__all__ = ["ClassificationTask", "MultiTaskModule"]
