"""Positions: RoPE's relative property and precision, ALiBi slopes, sinusoidal values, resampling."""

import math

import pytest
import torch

from mmformer.nn import RotaryEmbedding, alibi_slopes, resample_pos_embed, sinusoidal


def _rope_scores(rope, q, k, pos_q, pos_k):
    cq, sq = rope(torch.full((1, 1, rope.n_axes), pos_q))
    ck, sk = rope(torch.full((1, 1, rope.n_axes), pos_k))
    return (RotaryEmbedding.apply(q, cq, sq) * RotaryEmbedding.apply(k, ck, sk)).sum(-1)


@pytest.mark.parametrize("axes", [1, 2])
def test_rope_scores_depend_only_on_relative_position(axes):
    rope = RotaryEmbedding(16, n_axes=axes)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    base = _rope_scores(rope, q, k, 7, 3)
    for shift in (1, 100, 2000):
        torch.testing.assert_close(_rope_scores(rope, q, k, 7 + shift, 3 + shift), base, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(_rope_scores(rope, q, k, 8, 3), base)


def test_multi_axis_rope_reduces_to_1d_when_the_index_repeats():
    one, two = RotaryEmbedding(16), RotaryEmbedding(16, n_axes=2)
    pos = torch.arange(7).view(1, 7, 1)
    for a, b in zip(one(pos), two(pos.expand(1, 7, 2))):  # text tokens: the same index on every axis
        assert torch.equal(a, b)


def test_rope_2d_sections_follow_their_axis():
    rope = RotaryEmbedding(8, n_axes=2)  # 4 frequencies: 2 for rows, 2 for columns
    cos_a, _ = rope(torch.tensor([[[3, 0]]]))
    cos_b, _ = rope(torch.tensor([[[3, 5]]]))
    cos_c, _ = rope(torch.tensor([[[1, 0]]]))
    row, col = [0, 1, 4, 5], [2, 3, 6, 7]  # rotate-half layout repeats the 4 frequencies
    assert torch.equal(cos_a[..., row], cos_b[..., row]) and not torch.equal(cos_a[..., col], cos_b[..., col])
    assert torch.equal(cos_a[..., col], cos_c[..., col]) and not torch.equal(cos_a[..., row], cos_c[..., row])
    with pytest.raises(ValueError, match="sections"):
        RotaryEmbedding(8, n_axes=2, sections=[3, 3])


def test_rope_matches_the_reference_formula():
    rope = RotaryEmbedding(4, base=100.0)
    cos, sin = rope(torch.tensor([[[2]]]))
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    # pairs (x0, x2) and (x1, x3) rotate by 2·θ_i with θ = 100^(-0/4), 100^(-2/4)
    a0, a1 = 2 * 1.0, 2 * 0.1
    expected = [
        1 * math.cos(a0) - 3 * math.sin(a0),
        2 * math.cos(a1) - 4 * math.sin(a1),
        3 * math.cos(a0) + 1 * math.sin(a0),
        4 * math.cos(a1) + 2 * math.sin(a1),
    ]
    torch.testing.assert_close(RotaryEmbedding.apply(x, cos, sin).flatten(), torch.tensor(expected))


def test_rope_bf16_matches_float32_at_long_positions():
    rope = RotaryEmbedding(64, base=10_000.0)
    x = torch.randn(1, 2, 4, 64)
    cos, sin = rope(torch.tensor([[[4093], [4094], [4095], [4096]]]))
    assert cos.dtype == torch.float32 and rope.to(torch.bfloat16).inv_freq().dtype == torch.float32
    ref = RotaryEmbedding.apply(x, cos, sin)
    got = RotaryEmbedding.apply(x.bfloat16(), cos, sin).float()
    assert (got - ref).abs().max() < 0.05  # only the result is rounded to bf16, never the angles


def test_alibi_slopes_match_the_paper():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    expected_12 = [2.0 ** -(i + 1) for i in range(8)] + [
        2.0 ** -(i + 0.5) for i in (0, 1, 2, 3)
    ]  # every other slope of the 16-head sequence
    assert torch.allclose(alibi_slopes(12), torch.tensor(expected_12))
    assert len(alibi_slopes(6)) == 6


def test_sinusoidal_values():
    f = sinusoidal(torch.tensor([0.0, 1.0]), 4, base=10_000.0)
    assert torch.allclose(f[0], torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert torch.allclose(f[1], torch.tensor([math.sin(1), math.sin(0.01), math.cos(1), math.cos(0.01)]))


def test_resample_pos_embed():
    pe = torch.randn(1, 1 + 16, 8)
    same = resample_pos_embed(pe, (4, 4), num_prefix_tokens=1)
    torch.testing.assert_close(same, pe, atol=1e-5, rtol=1e-5)
    bigger = resample_pos_embed(pe, (6, 6), num_prefix_tokens=1)
    assert bigger.shape == (1, 37, 8) and torch.equal(bigger[:, 0], pe[:, 0])
    seq = torch.arange(4.0).view(1, 4, 1)
    assert resample_pos_embed(seq, 4).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert resample_pos_embed(seq, 8).shape == (1, 8, 1)


def test_rope_traces_as_one_graph():
    """The sections' axis index is built from Python ints: no data-dependent size, so a compiled decoding
    step does not break (and re-enter) its graph at every RoPE (``torch._dynamo.explain``)."""
    rope = RotaryEmbedding(16, n_axes=2, sections=[3, 5])
    positions = torch.randint(0, 50, (2, 5, 2))
    explained = torch._dynamo.explain(rope)(positions)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    cos, sin = rope(positions)
    pos = positions.float()[..., [0] * 3 + [1] * 5] * rope.inv_freq()  # the sections, written out
    torch.testing.assert_close(cos, torch.cat([pos, pos], -1).unsqueeze(1).cos())
