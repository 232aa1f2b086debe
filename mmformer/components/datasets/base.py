"""What the dataset kinds share: the loader fields (``LoaderConfig``) and the task a data node belongs to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from ...errors import positive


def task_of(recipe, where: str):
    """The task config whose ``data`` is at ``where`` (``tasks.<name>.data``)."""
    return recipe.tasks[where.split(".")[1]]


@dataclass
class LoaderConfig:
    """What every file-backed dataset kind has: where the data is and how it is batched. A kind
    redeclares a field only to change its default."""

    kind: str = MISSING
    root: str = MISSING  # a path, or a bundled dataset name (``mmformer data list``) under the data root
    batch_size: int = 32
    val_batch_size: Optional[int] = None  # default: batch_size
    num_workers: int = 0  # data-loader worker processes per rank
    drop_last: bool = True  # training: drop the last incomplete batch

    def __post_init__(self) -> None:
        positive(self, "batch_size", "val_batch_size")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
