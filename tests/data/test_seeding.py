"""Per-sample augmentation streams: a training sample's random draw in an epoch depends only on the data
seed, the epoch and the sample — not on the loader worker or rank that prepares it, nor on where a
resumed epoch starts — and the stream of the process around it is left as it was."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torchvision.transforms import v2

from mmformer.data.samplers import ResumableShardSampler
from mmformer.data.seeding import SeededSamples, sample_seed
from mmformer.data.shards import ShardStream, image_decoder, read_index
from mmformer.tokenizers.image import ImagePreprocess
from tests.data.test_shards import image_shards  # noqa: F401  (fixture)


class _Draws(torch.utils.data.Dataset):
    """Item i: (i, a torch draw, a torchvision random crop + flip of a fixed image)."""

    def __init__(self, n: int = 12):
        self.n = n
        self.crop = v2.Compose([v2.RandomCrop(8, padding=2), v2.RandomHorizontalFlip()])
        self.image = torch.arange(64, dtype=torch.uint8).reshape(1, 8, 8)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i, torch.rand(()), self.crop(self.image)


def _by_sample(world: int, workers: int, epoch: int = 0, skip: int = 0) -> dict[int, tuple]:
    out = {}
    for rank in range(world):
        data = SeededSamples(_Draws(), seed=7)
        sampler = ResumableShardSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=7)
        for part in (data, sampler):
            part.set_epoch(epoch)
        sampler.skip(skip)
        loader = torch.utils.data.DataLoader(
            data, batch_size=2, sampler=sampler, num_workers=workers, generator=sampler.generator
        )
        for idx, draw, image in loader:
            out.update({int(i): (float(d), image[k].tolist()) for k, (i, d) in enumerate(zip(idx, draw))})
    return out


def test_a_samples_draw_is_the_same_for_any_worker_rank_or_resume_point():
    one = _by_sample(world=1, workers=0)
    assert sorted(one) == list(range(12))
    assert _by_sample(world=1, workers=2) == one
    assert _by_sample(world=2, workers=2) == one  # each sample on one of 2 ranks, same draw
    resumed = _by_sample(world=1, workers=2, skip=6)
    assert len(resumed) == 6 and all(one[i] == v for i, v in resumed.items())
    # the next epoch draws afresh; different samples draw differently
    later = _by_sample(world=1, workers=0, epoch=1)
    assert all(later[i][0] != one[i][0] for i in one)
    assert len({v[0] for v in one.values()}) == 12
    assert len({str(v[1]) for v in one.values()}) > 4  # crops and flips vary over samples


def test_the_surrounding_stream_is_untouched():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)  # also queues the CUDA generators' seed (3), applied when CUDA starts
    data = SeededSamples(_Draws(), seed=0)
    _ = [data[i] for i in range(5)]
    assert torch.equal(torch.rand(4), expected)
    queued = torch.cuda._lazy_seed_tracker.manual_seed_all_cb  # (callback, stack) of the last seed_all
    if queued is not None and not torch.cuda.is_initialized():
        assert queued[0].__closure__[0].cell_contents == 3  # not reseeded per sample


def test_two_tasks_draw_differently_for_the_same_index():
    a, b = SeededSamples(_Draws(), 7, "shapes")[3], SeededSamples(_Draws(), 7, "digits")[3]
    assert a[1] != b[1]


def test_seeds_are_stable_across_processes_and_distinct():
    code = "from mmformer.data.seeding import sample_seed; print(sample_seed(3, 1, 'shard-0.tar/000007'))"
    for hash_seed in ("1", "2"):  # Python's str hash differs between these; the sample seed must not
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert int(out.stdout) == sample_seed(3, 1, "shard-0.tar/000007")
    seeds = {sample_seed(s, e, k) for s in (0, 1) for e in (0, 1) for k in range(50)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)


def test_augmented_shards_resumed_mid_epoch_draw_as_the_uninterrupted_epoch(image_shards):  # noqa: F811
    _, out = image_shards
    pre = ImagePreprocess(28, 1, [v2.RandomCrop(28, padding=4), v2.RandomHorizontalFlip()])

    image = image_decoder(pre)

    def decode(raw):
        return {"key": raw["__key__"], **image(raw)}

    def read(workers: int, skip: int = 0) -> dict[str, list]:
        info = read_index(out)
        stream = ShardStream(out, info["splits"]["train"], decode, True, 2, 1, 0, seed=0, shuffle_buffer=4)
        stream.skip(skip)
        loader = torch.utils.data.DataLoader(stream, batch_size=2, num_workers=workers)
        return {k: b["image"][j].tolist() for b in loader for j, k in enumerate(b["key"])}

    full = read(workers=2)
    assert len(full) == 24
    assert read(workers=0) == full  # each sample's crop and flip do not depend on the worker
    rest = read(workers=2, skip=8)
    assert len(rest) == 16 and all(full[k] == v for k, v in rest.items())
