"""Samplers that stay correct under data parallelism and resume exactly mid-epoch."""

from __future__ import annotations

import math
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


class EvenEvalBatches(Sampler[list[int]]):
    """``EvalShardSampler``'s indices for rank ``rank`` cut into the same number of batches on every rank:
    ``K = ceil(ceil(length / world) / batch_size)`` batches of near-equal size (they differ by at most
    one sample; none above ``batch_size``). Every sample is still read exactly once over the ranks.

    Needed when the model is sharded (FSDP2): each evaluation forward gathers weights from every rank,
    so a rank with one batch more than the others would wait for them forever.

    Raises ``ValueError`` when a rank has fewer samples than ``K`` (a tiny set: lower the batch count
    with a larger ``val_batch_size``, or use fewer processes).
    """

    def __init__(self, length: int, world: int, rank: int, batch_size: int):
        self.indices = list(EvalShardSampler(length, world, rank))
        self.num_batches = math.ceil(math.ceil(length / world) / batch_size)
        if len(self.indices) < self.num_batches:
            raise ValueError(
                f"{length} evaluation samples over {world} processes cannot give every process "
                f"{self.num_batches} batches of at most {batch_size}"
            )

    def __iter__(self) -> Iterator[list[int]]:
        n, k = len(self.indices), self.num_batches
        bounds = [i * n // k for i in range(k + 1)]
        for a, b in zip(bounds, bounds[1:]):
            yield self.indices[a:b]

    def __len__(self) -> int:
        return self.num_batches


class ResumableShardSampler(DistributedSampler):
    """torch's ``DistributedSampler`` (seeded shuffle of ``(seed, epoch)``, shards by rank) that can
    start its next pass part-way: ``skip(n)`` drops the first ``n`` indices of the next iteration only,
    so a run resumed mid-epoch reads exactly the samples the interrupted epoch had not reached, without
    loading the ones it skips. ``len`` stays the full pass.

    ``generator`` (give it to the ``DataLoader`` too) is reseeded by every ``set_epoch`` from
    ``(seed, rank, epoch)``: the loader draws its workers' base seed from it, so data-loader workers get
    random streams that are distinct per rank and worker, change every epoch, and are the same in a
    rerun — or in a run resumed at that epoch (with workers re-created each epoch). Augmentation does not
    depend on them: each sample draws from its own seeded stream (``seeding.SeededSamples``).
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


def set_epoch(loader, epoch: int) -> None:
    """Set ``epoch`` on whichever parts of ``loader`` order or augment its data (sampler, batch sampler,
    dataset)."""
    for part in (loader.batch_sampler, loader.sampler, loader.dataset):
        if hasattr(part, "set_epoch"):
            part.set_epoch(epoch)


def start_part_way(loader, batches: int) -> Iterator:
    """``iter(loader)`` beginning at its batch ``batches`` (its sampler, or a streaming dataset, skips the
    samples before)."""
    if batches:
        if isinstance(loader.batch_sampler, LengthBuckets):
            loader.batch_sampler.skip(batches)
        else:
            skipper = loader.dataset if isinstance(loader.dataset, IterableDataset) else loader.sampler
            skipper.skip(batches * loader.batch_size)
    return iter(loader)


class LengthBuckets(Sampler[list[int]]):
    """Batches of samples of similar length (fairseq's / HF's ``group_by_length``), for variable-length
    text and audio: this rank's shuffled indices (``sampler``) are cut into chunks of ``chunk`` batches,
    each chunk sorted by ``lengths`` and cut into batches, and the batches of a chunk shuffled — so
    padding shrinks while the data order stays random and a function of ``(seed, rank, epoch)``.
    ``set_epoch`` / ``skip(batches)`` as the sampler's (``skip`` counts batches here)."""

    def __init__(
        self,
        sampler: ResumableShardSampler,
        lengths,
        batch_size: int,
        drop_last: bool = True,
        chunk: int = 50,
    ):
        if len(lengths) != len(sampler.dataset):
            raise ValueError(f"{len(lengths)} lengths for {len(sampler.dataset)} samples")
        self.sampler, self.lengths, self.batch_size = sampler, list(lengths), batch_size
        self.drop_last, self.chunk, self._skip = drop_last, chunk, 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def skip(self, batches: int) -> None:
        self._skip = batches

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        indices = list(self.sampler)
        g = torch.Generator().manual_seed(
            hash((self.sampler.seed, self.sampler.rank, self.sampler.epoch)) % 2**63
        )
        size = self.batch_size * self.chunk
        batches = []
        for start in range(0, len(indices), size):
            part = sorted(indices[start : start + size], key=lambda i: self.lengths[i])
            cut = [part[k : k + self.batch_size] for k in range(0, len(part), self.batch_size)]
            order = torch.randperm(len(cut), generator=g).tolist()
            batches += [cut[k] for k in order]
        full = [b for b in batches if len(b) == self.batch_size]
        batches = (full if self.drop_last else batches)[: len(self)]
        skip, self._skip = self._skip, 0
        return iter(batches[skip:])
