"""Checkpoint files: atomic writes (a temporary file in the same folder, fsync, rename over the target:
a run killed mid-save leaves the previous ``last.ckpt`` intact, never a truncated one), ``weights_only``
reading, and the always-fresh ``last.ckpt``.

Whatever goes wrong with a checkpoint file is one :class:`CheckpointError` line naming it: a full disk or
a read-only folder while writing (the previous file kept, no temporary left), and an empty, truncated,
foreign or unsafe (pickled code) file while reading. Every loader reads through :func:`read_checkpoint_file`.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info

from ..errors import UsageError

ZIP_MAGIC = b"PK\x03\x04"  # what every torch.save (zip format) file starts with
PICKLE_PROTO = b"\x80"  # what a legacy (pre-1.6 format) torch.save file starts with: a pickle
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
# torch's C++ writer turns a failed write into one of these (the OSError itself is lost)
TORCH_WRITE_FAILED = ("unexpected pos", "file write failed", "failed writing file", "iostream error")


class CheckpointError(UsageError):
    """A checkpoint file that cannot be written (a full disk, a read-only folder) or read (empty,
    truncated, not a checkpoint, pickled code refused); the message is one line naming the file."""


# ----------------------------------------------------------------------------------------------- reading
def read_checkpoint_file(path: str | Path, mmap: bool = False, map_location="cpu") -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` (``mmap``: tensors mapped, not read, for a zip-format
    file). Nothing but tensors and plain containers is unpickled: no code of the file runs.

    Raises:
        CheckpointError: ``path`` is empty, truncated or damaged, not a PyTorch checkpoint, or carries
            pickled objects (refused). A missing file raises ``FileNotFoundError``.
    """
    path = Path(path)
    zipped = zipfile.is_zipfile(path)
    if not zipped:
        _check_header(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and zipped)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e) and "Unsupported operand" not in str(e):
            raise CheckpointError(_unsafe(path, str(e))) from None
        raise CheckpointError(_damaged(path, e) if zipped else _not_a_checkpoint(path)) from None
    except RuntimeError as e:
        if zipped and "PytorchStreamReader" not in str(e):
            raise
        raise CheckpointError(_damaged(path, e) if zipped else _not_a_checkpoint(path)) from None
    except (EOFError, KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
        if zipped:
            raise
        raise CheckpointError(_not_a_checkpoint(path)) from e  # garbage to a legacy unpickler


def _check_header(path: Path) -> None:
    """Raises ``CheckpointError`` for a file (not a whole zip archive) that cannot be a checkpoint: empty,
    a truncated zip archive, or neither a zip archive nor a pickle (the legacy format)."""
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a folder without .metadata, not a checkpoint (nor a whole sharded one)"
        )
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes: its save never finished)")
    with open(path, "rb") as f:
        head = f.read(len(ZIP_MAGIC))
    if head == ZIP_MAGIC:
        raise CheckpointError(f"{path} is truncated ({size} bytes: the end of its zip archive is missing)")
    if not head.startswith(PICKLE_PROTO):
        raise CheckpointError(_not_a_checkpoint(path))


def _unsafe(path: Path, torch_message: str) -> str:
    found = re.search(r"Unsupported global: GLOBAL (\S+)", torch_message)
    what = f": {found.group(1)}" if found else ""
    return f"{path} is not a weights-only checkpoint and was refused for safety (it would run pickled code{what})"


def _damaged(path: Path, e: Exception) -> str:
    return f"{path} is damaged ({str(e).strip().split('. ')[0]})"


def _not_a_checkpoint(path: Path) -> str:
    return f"{path} is not a PyTorch checkpoint (neither a torch.save zip archive nor a legacy one)"


# ----------------------------------------------------------------------------------------------- writing
class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        """Write ``checkpoint`` to ``path`` through a temporary file renamed over it.

        Raises:
            CheckpointError: the disk is full or the folder read-only (or another write error): the
                previous ``path`` is left as it was and the temporary file is removed.
        """
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_temporaries(path, tmp)
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except (OSError, RuntimeError) as e:
            _remove(tmp)  # before measuring the free space: the half-written file's bytes are free again
            error = write_error(e, path, _tensor_bytes(checkpoint))
            if error is None:
                raise
            raise error from e
        finally:
            _remove(tmp)

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = True) -> dict[str, Any]:
        # Checkpoints hold only tensors and plain containers: never unpickle arbitrary objects.
        return read_checkpoint_file(path, map_location=map_location or "cpu")


def _remove_stale_temporaries(path: Path, mine: Path) -> None:
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a process killed mid-save
        if stale != mine:
            stale.unlink(missing_ok=True)


def _remove(tmp: Path) -> None:
    try:
        tmp.unlink(missing_ok=True)
    except OSError:  # e.g. the folder turned read-only: nothing was written there either
        pass


def write_error(e: BaseException, path: Path, needed: int = 0) -> CheckpointError | None:
    """The one-line :class:`CheckpointError` for a failed write of ``path`` (``needed``: bytes it would
    take), or None for an error that is not about storage (a bug: let it be seen whole)."""
    os_error = next((x for x in _chain(e) if isinstance(x, OSError) and x.errno is not None), None)
    torch_failed = any(isinstance(x, RuntimeError) and _torch_write_failed(x) for x in _chain(e))
    if os_error is None and not torch_failed:
        return None
    free, fs = _free_space(path)
    kept = f"; the previous {path.name} is kept" if path.exists() else ""
    if (os_error is not None and os_error.errno in DISK_FULL) or (os_error is None and free < max(needed, 1)):
        needs = f"it needs ~{needed / 1e6:.1f} MB, " if needed else ""
        return CheckpointError(
            f"disk full while writing {path}: {needs}{free / 1e6:.1f} MB free on {fs}{kept}"
        )
    if os_error is not None and os_error.errno in READ_ONLY:
        folder = fs if os_error.errno == errno.EROFS else _existing(path.parent)
        return CheckpointError(f"could not write {path}: {folder} is read-only ({os_error.strerror}){kept}")
    if os_error is not None:
        return CheckpointError(f"could not write {path}: {os_error.strerror}{kept}")
    return CheckpointError(
        f"could not write {path}: the file system refused the write ({str(e).strip()}) with "
        f"{free / 1e6:.1f} MB free on {fs}{kept}"
    )


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _torch_write_failed(e: RuntimeError) -> bool:
    return any(s in str(e) for s in TORCH_WRITE_FAILED)


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent."""
    return next(p for p in (path, *path.parents) if p.exists())


def _free_space(path: Path) -> tuple[int, Path]:
    """``(free bytes, mount point)`` of the file system ``path`` is (or would be) on."""
    folder = _existing(path.parent)
    fs = folder.resolve()
    while not os.path.ismount(fs) and fs != fs.parent:
        fs = fs.parent
    return shutil.disk_usage(folder).free, fs


def _tensor_bytes(obj) -> int:
    """About what ``torch.save(obj)`` writes: the bytes of the tensors in it."""
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes() if obj.device.type != "meta" else 0
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class LastCheckpoint(ModelCheckpoint):
    """Keeps ``last.ckpt`` = the newest state whatever the monitored metric did: written after every
    validation (with ``every_n_train_steps``: every N optimizer steps instead — after that step's
    validation when one follows it, so a resumed run never skips it) and when training ends.

    Lightning 2.6's ``save_last=True`` rewrites ``last.ckpt`` only on steps where a top-k checkpoint
    was saved, which would make ``resume=auto`` restart from a stale state.
    """

    def __init__(self, dirpath: str, every_n_train_steps: int | None = None):
        super().__init__(
            dirpath=dirpath,
            filename="last",
            monitor=None,
            save_top_k=1,
            save_last=False,
            enable_version_counter=False,
            every_n_train_steps=every_n_train_steps,
        )

    @property
    def state_key(self) -> str:
        return "LastCheckpoint"

    def _due(self, trainer) -> bool:
        return self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Lightning validates after on_train_batch_end, and a run resumed from a checkpoint written
        # here skips that validation (it counts the step as done): when one follows, save after it.
        if self._due(trainer) and validation_follows(trainer):
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._due(trainer) and not self._should_skip_saving_checkpoint(trainer):
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
        super().on_validation_end(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._last_global_step_saved != trainer.global_step and not trainer.sanity_checking:
            self._save_checkpoint(trainer, self.format_checkpoint_name({}))

    def save_now(self, trainer) -> str | None:
        """Write ``last.ckpt`` now unless it already holds this step (every rank calls this at the same
        point: a stop on a signal); returns its path, or None when there is none on disk (a sharded
        checkpoint is a folder)."""
        path = self.format_checkpoint_name({})
        if self._last_global_step_saved != trainer.global_step:
            rank_zero_info(f"saving {path} at step {trainer.global_step}")
            self._save_checkpoint(trainer, path)
        return path if os.path.exists(path) else None


def validation_follows(trainer) -> bool:
    """Whether Lightning runs a validation right after the current training batch (called from
    ``on_train_batch_end``): the loop's own decision (``_should_check_val_fx``, Lightning 2.6)."""
    loop = trainer.fit_loop.epoch_loop
    return bool(trainer.enable_validation) and loop._should_check_val_fx(trainer.fit_loop._data_fetcher)


def resume_hint(trainer) -> str:
    """One sentence for a run that stops on an error: the ``last.ckpt`` it can resume from (and its
    step), else its newest checkpoint, else that none was written yet."""
    folders = {Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
    found = sorted((p for d in folders for p in d.glob("*.ckpt")), key=lambda p: p.stat().st_mtime)
    last = next((p for p in found if p.name == "last.ckpt"), None)
    if last is not None:
        try:
            step = f" (step {read_checkpoint_file(last, mmap=True)['global_step']})" if last.is_file() else ""
        except (CheckpointError, KeyError):
            step = ""
        return f"The last checkpoint is {last}{step}: resume=auto continues from it."
    if found:
        return f"Its newest checkpoint is {found[-1]}: resume={found[-1]} continues from it."
    return (
        "No checkpoint of this run was written yet, so there is nothing to resume: start it again once fixed."
    )


NOT_MMFORMER = "is not an mmformer training checkpoint (no recipe inside: mmformer train stores one in each)"


def carries_recipe(checkpoint) -> bool:
    """Whether a loaded checkpoint is an mmformer training checkpoint (one that carries its recipe)."""
    own = checkpoint.get("mmformer") if isinstance(checkpoint, dict) else None
    return isinstance(own, dict) and "recipe_yaml" in own
