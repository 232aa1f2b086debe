"""``RandomCropFlip`` computes what torchvision's ``RandomCrop(size, padding)`` + ``RandomHorizontalFlip()``
compute, from the same draws of torch's generator."""

import pytest
import torch
from torchvision.transforms import v2

from mmformer.data.crop_flip import RandomCropFlip


def reference(size: int, padding: int, hflip: bool):
    steps = []
    if padding:
        steps.append(v2.RandomCrop(size, padding=padding))
    if hflip:
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose(steps)


@pytest.mark.parametrize(
    "shape,size,padding,hflip",
    [
        ((1, 28, 28), 28, 2, False),  # the quickstart's
        ((1, 28, 28), 28, 2, True),
        ((3, 32, 32), 32, 4, True),  # CIFAR-10's
        ((3, 32, 32), 32, 0, True),  # flip only
        ((3, 9, 7), 6, 1, True),  # a non-square image, a smaller window
        ((2, 5, 5), 5, 5, False),  # padding as large as the image: windows of nothing but padding
        ((1, 28, 28), 4, 20, True),  # padding beyond the window: windows wholly above / left of the image
    ],
)
def test_equals_torchvision_draw_for_draw(shape, size, padding, hflip):
    ours, theirs = RandomCropFlip(size, padding, 0.5 if hflip else 0.0), reference(size, padding, hflip)
    image = torch.randint(0, 256, shape, dtype=torch.uint8)
    seen = set()
    for seed in range(200):
        torch.manual_seed(seed)
        got = ours(image)
        after_ours = torch.rand(1)  # the generator advanced exactly as far on both sides
        torch.manual_seed(seed)
        want = theirs(image)
        assert torch.equal(got, want), seed
        assert got.dtype == torch.uint8 and got.shape == (shape[0], size, size)
        assert torch.equal(after_ours, torch.rand(1))
        seen.add(got.numpy().tobytes())
    assert len(seen) >= (10 if padding else 2)  # the draws really vary the output


def test_output_does_not_share_memory_with_the_cached_image():
    image = torch.randint(0, 256, (1, 8, 8), dtype=torch.uint8)
    kept = image.clone()
    out = RandomCropFlip(8, 0, 0.0)(image)  # no crop, no flip: still a copy
    out += 1
    assert torch.equal(image, kept)


def test_refuses_a_window_larger_than_the_padded_image():
    with pytest.raises(ValueError, match="larger than padded input image size"):
        RandomCropFlip(32, 1)(torch.zeros(1, 28, 28, dtype=torch.uint8))
    with pytest.raises(ValueError, match="padding must be >= 0"):
        RandomCropFlip(28, -1)
