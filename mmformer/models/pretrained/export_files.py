"""Exported weights with a normal file's permissions. safetensors' ``save_file`` writes a private
temporary file (mode 0600) and renames it into place, so an export meant to be shared would be readable
by its owner alone while the ``config.json`` beside it is not: :func:`save_safetensors` gives the file
the mode ``open()`` would (0666 less the process umask)."""

from __future__ import annotations

import os
from pathlib import Path

from torch import Tensor


def save_safetensors(
    tensors: dict[str, Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> Path:
    """``safetensors.torch.save_file(tensors, path, metadata)``, then the mode of a newly created file."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~umask())
    return Path(path)


def umask() -> int:
    """The process umask (read from ``/proc`` where there is one: setting it to read it back is racy)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
