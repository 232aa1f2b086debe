"""ViT patch tokenizer: uint8 normalisation, token layout, positions, shape errors."""

import pytest
import torch

from mmformer.tokenizers import ViTPatchTokenizer


def test_uint8_pixels_are_scaled_and_normalised_like_torchvision():
    from torchvision.transforms import v2

    tok = ViTPatchTokenizer(
        16, image_size=8, patch_size=4, in_chans=3, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3)
    )
    raw = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    ref = v2.Normalize((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))(v2.ToDtype(torch.float32, scale=True)(raw))
    torch.testing.assert_close(tok(raw).x, tok(ref).x, atol=1e-5, rtol=1e-5)


def test_tokens_layout_and_positions():
    tok = ViTPatchTokenizer(16, image_size=8, patch_size=4, in_chans=1, mean=(0.5,), std=(0.5,))
    t = tok(torch.zeros(2, 1, 8, 8))
    assert t.x.shape == (2, 5, 16) and t.valid.all()
    assert t.positions[0].tolist() == [[0, 0], [0, 0], [0, 1], [1, 0], [1, 1]]  # cls, then row-major grid
    assert tok.num_prefix_tokens == 1
    no_cls = ViTPatchTokenizer(16, 8, 4, 1, class_token=False, mean=(0.5,), std=(0.5,))
    assert no_cls(torch.zeros(1, 1, 8, 8)).x.shape == (1, 4, 16) and no_cls.num_prefix_tokens == 0


def test_wrong_input_shape_is_named():
    tok = ViTPatchTokenizer(16, 8, 4, 1, mean=(0.5,), std=(0.5,))
    with pytest.raises(ValueError, match=r"expects pixels \(B, 1, 8, 8\), got \(2, 3, 8, 8\)"):
        tok(torch.zeros(2, 3, 8, 8))
