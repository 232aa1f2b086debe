"""Per-sample random streams for training-time augmentation.

Every training sample is prepared (decoded, cropped, flipped, noised) inside ``seeded(sample_seed(seed,
epoch, key))``: torch's CPU generator is seeded from the run's data seed, the epoch and the sample's own
key (its index in the dataset, or its shard member name) and restored afterwards. So a sample's
augmentation in an epoch is one fixed draw — the same whichever rank or loader worker prepares it, with any
``num_workers``, and in a run resumed mid-epoch (where per-worker streams would restart at the epoch's
seed and the rest of the epoch would be augmented differently from the uninterrupted run). The stream
of the process around it (the task's noise, masking, dropout) is untouched.

torchvision's v2 transforms, torchaudio's masking and ``AudioPreprocess.augment`` draw from torch's
generator, so seeding it covers them (Python's ``random`` and NumPy's global streams are not seeded; nor
is CUDA's: data preparation runs on the CPU).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.data import Dataset


def sample_seed(seed: int, epoch: int, key: int | str) -> int:
    """A 63-bit seed for sample ``key`` in ``epoch``, stable across processes and Python runs (BLAKE2b of
    the three; Python's ``hash`` of a string changes with ``PYTHONHASHSEED``)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's CPU generator seeded by ``seed``; its previous state is restored after
    (what ``torch.random.fork_rng(devices=[])`` does, at half its cost: it runs once per sample)."""
    generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(seed)  # not torch.manual_seed: that also reseeds CUDA's
    try:
        yield
    finally:
        generator.set_state(state)


class SeededSamples(Dataset):
    """A map-style training dataset whose item ``i`` is prepared inside ``seeded(sample_seed(seed, epoch,
    f"{name}/{i}"))``. ``set_epoch`` (called by the datamodule before each pass, before the loader
    starts its workers) moves every sample to its next draw. ``name`` (the task's) keeps two tasks'
    sample ``i`` from drawing alike."""

    def __init__(self, dataset: Dataset, seed: int, name: str = ""):
        self.dataset, self.seed, self.name, self.epoch = dataset, seed, name, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        with seeded(sample_seed(self.seed, self.epoch, f"{self.name}/{i}")):
            return self.dataset[i]
