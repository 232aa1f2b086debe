"""Samplers that stay correct under data parallelism."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler


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
