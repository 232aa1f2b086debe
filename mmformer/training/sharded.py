"""Sharded checkpoints (``checkpoint.sharded: true`` under ``trainer.strategy: fsdp2``): every rank writes
its own shard of the weights and optimizer state (``torch.distributed.checkpoint``, Lightning's layout: a
folder with ``.metadata``, one ``*.distcp`` file per rank and ``meta.pt`` holding everything else), so no
rank ever holds the whole model. ``read_checkpoint`` reads either kind as one ordinary checkpoint
dictionary; ``export_safetensors`` merges the weights into one safetensors file.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from .checkpoint_io import read_checkpoint_file

META = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint


def is_sharded(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint without its tensors' shards: everything for a sharded folder's ``meta.pt`` (recipe,
    tokenizers, loop state), the whole dictionary for a file. Loaded with ``weights_only=True``.

    Raises ``CheckpointError`` for a damaged, foreign or unsafe file (:func:`read_checkpoint_file`)."""
    path = Path(path)
    if is_sharded(path):
        return read_checkpoint_file(path / META)
    return read_checkpoint_file(path, mmap=True)


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint file, or a sharded checkpoint folder merged in this process's memory (its shards
    gathered into full tensors: ``state_dict`` and ``optimizer_states``), as one dictionary.

    Raises ``FileNotFoundError`` for a path that is neither, ``CheckpointError`` for a damaged, foreign
    or unsafe file (:func:`read_checkpoint_file`)."""
    path = Path(path)
    if path.is_file():
        return read_checkpoint_file(path)
    if not is_sharded(path):
        raise FileNotFoundError(f"{path} is neither a checkpoint file nor a sharded checkpoint folder")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged.pt"
        dcp_to_torch_save(path, merged)  # no process group needed: read on one process
        tensors = read_checkpoint_file(merged)
    checkpoint = read_meta(path)
    checkpoint["state_dict"] = tensors.pop("state_dict")
    optimizers = sorted(k for k in tensors if k.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [tensors[k] for k in optimizers]
    return checkpoint


def export_safetensors(path: str | Path, out: str | Path) -> int:
    """Write a checkpoint's weights (file or sharded folder) to one safetensors file ``out``, keys as in
    the LightningModule's ``state_dict`` (``model.…``), with the recipe YAML in the file's metadata.
    Returns the number of tensors written."""
    from ..models.pretrained.export_files import save_safetensors

    checkpoint = read_checkpoint(path)
    state, seen = {}, set()
    for k, v in checkpoint["state_dict"].items():  # tied weights (an LM head) are stored once per name
        ptr = v.untyped_storage().data_ptr()
        state[k] = v.contiguous().clone() if ptr in seen else v.contiguous()
        seen.add(ptr)
    recipe = checkpoint.get("mmformer", {}).get("recipe_yaml", "")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(state, out, metadata={"format": "pt", "mmformer_recipe": recipe})
    return len(state)
