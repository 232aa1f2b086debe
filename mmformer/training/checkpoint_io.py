"""Atomic checkpoint writes: save to a temporary file in the same folder, fsync, then rename over
the target. A run killed mid-save leaves the previous ``last.ckpt`` intact, never a truncated one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = True) -> dict[str, Any]:
        # Checkpoints hold only tensors and plain containers: never unpickle arbitrary objects.
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)
