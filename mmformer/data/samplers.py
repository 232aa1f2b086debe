"""Samplers that stay correct under data parallelism and resume exactly mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler, IterableDataset, Sampler


class EvalShardSampler(Sampler[int]):
    """Rank ``r`` of ``w`` takes indices ``r, r + w, r + 2w, …`` in order, without padding, so metrics
    synchronised over ranks count every evaluation sample exactly once (torch's
    ``DistributedSampler`` repeats samples to even out the shards, which inflates evaluation)."""

    def __init__(self, length: int, num_replicas: int = 1, rank: int = 0):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.length, self.num_replicas, self.rank = length, num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.num_replicas))


class ResumableShardSampler(DistributedSampler):
    """torch's ``DistributedSampler`` (seeded shuffle of ``(seed, epoch)``, shards by rank) that can
    start its next pass part-way: ``skip(n)`` drops the first ``n`` indices of the next iteration only,
    so a run resumed mid-epoch reads exactly the samples the interrupted epoch had not reached, without
    loading the ones it skips. ``len`` stays the full pass.

    ``generator`` (give it to the ``DataLoader`` too) is reseeded by every ``set_epoch`` from
    ``(seed, rank, epoch)``: the loader draws its workers' base seed from it, so data-loader workers get
    random streams (augmentation) that are distinct per rank and worker, change every epoch, and are
    the same in a rerun — or in a run resumed at that epoch (with workers re-created each epoch).
    """

    _skip = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generator = torch.Generator()
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.generator.manual_seed(hash((self.seed, self.rank, epoch)) % 2**63)

    def skip(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"cannot skip {n} samples")
        self._skip = n

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self._skip = self._skip, 0
        return iter(indices[skip:])


def start_part_way(loader, batches: int) -> Iterator:
    """``iter(loader)`` beginning at its batch ``batches`` (its sampler, or a streaming dataset, skips the
    samples before)."""
    if batches:
        skipper = loader.dataset if isinstance(loader.dataset, IterableDataset) else loader.sampler
        skipper.skip(batches * loader.batch_size)
    return iter(loader)
