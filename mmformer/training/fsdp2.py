"""``trainer.strategy: fsdp2`` — FSDP2 (per-parameter sharding, ``torch.distributed.fsdp.fully_shard``)
over every process, through Lightning's ``ModelParallelStrategy``: one data-parallel mesh dimension of
size ``devices × num_nodes`` (no tensor parallelism). Runs on GPUs (NCCL) and on CPU processes (gloo).

Checkpoints are assembled on rank 0 into one ordinary file by default, so ``last.ckpt`` / ``resume`` /
``mmformer validate`` work exactly as with DDP, on any number of processes. With ``sharded=True``
(``checkpoint.sharded``) every rank writes its own shard instead (``training.sharded``: a folder, for
models whose full state does not fit one process), written to a temporary folder and renamed into place,
so a kill during the save leaves the previous checkpoint. The module's ``configure_model`` applies the
sharding (``models.parallelize.shard_model``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from lightning.pytorch.strategies import ModelParallelStrategy


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class FSDP2Strategy(ModelParallelStrategy):
    def __init__(self, sharded: bool = False, **kwargs):
        super().__init__(
            data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=sharded, **kwargs
        )

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        tmp, old = path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")
        if self.is_global_zero:
            for stale in (tmp, old):
                _remove(stale)
        self.barrier("sharded checkpoint: clean")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("sharded checkpoint: written")
        if self.is_global_zero:  # the previous checkpoint stays until the new one is complete
            if path.exists():
                path.rename(old)
            tmp.rename(path)
            _remove(old)
        self.barrier("sharded checkpoint: renamed")

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            _remove(Path(filepath))

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every process shards one model
        super().setup_environment()
