"""The composition root: model, datamodule, LightningModule and Trainer from a loaded recipe. The parts
are the registered components (``mmformer.components``); what a command loaded (a checkpoint's
tokenizers and pretrained architectures) reaches them as one ``BuildContext``."""

from ..components import BuildContext
from .checkpoint import LoadedCheckpoint, load_checkpoint
from .data import build_datamodule
from .model import build_model, build_module
from .trainer import build_strategy, build_trainer, default_monitor

__all__ = [
    "BuildContext",
    "LoadedCheckpoint",
    "build_datamodule",
    "build_model",
    "build_module",
    "build_strategy",
    "build_trainer",
    "default_monitor",
    "load_checkpoint",
]
