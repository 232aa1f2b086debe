"""Objectives (one module per kind of task, each a ``Task``) and the LightningModule that routes batches
to them."""

from .base import Task, TaskBase
from .classification import ClassificationTask
from .router import MultiTaskModule

__all__ = ["ClassificationTask", "MultiTaskModule", "Task", "TaskBase"]
