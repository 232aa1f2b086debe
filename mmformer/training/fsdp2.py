"""``trainer.strategy: fsdp2`` — FSDP2 (per-parameter sharding, ``torch.distributed.fsdp.fully_shard``)
over every process, through Lightning's ``ModelParallelStrategy``: one data-parallel mesh dimension of
size ``devices × num_nodes`` (no tensor parallelism). Runs on GPUs (NCCL) and on CPU processes (gloo).

Checkpoints are assembled on rank 0 into one ordinary file (``save_distributed_checkpoint=False``), so
``last.ckpt`` / ``resume`` / ``mmformer validate`` work exactly as with DDP, on any number of processes.
The module's ``configure_model`` applies the sharding (``models.parallelize.shard_model``).
"""

from __future__ import annotations

from lightning.pytorch.strategies import ModelParallelStrategy


class FSDP2Strategy(ModelParallelStrategy):
    def __init__(self, **kwargs):
        super().__init__(
            data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=False, **kwargs
        )

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every process shards one model
        super().setup_environment()
