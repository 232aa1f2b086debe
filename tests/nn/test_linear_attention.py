"""Random-feature (Performer FAVOR+) attention: converges to softmax attention as the features grow,
causal and with padding; its causal prefix sums equal the non-causal estimate on each prefix."""

from __future__ import annotations

import pytest
import torch

from mmformer.nn.attention import Attention, AttentionInputs, eager_attention
from mmformer.nn.linear_attention import favor_attention, orthogonal_features
from mmformer.nn.masks import MaskSpec


def _qkv(seed=0, n=24, d=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, n, d, generator=g) * 0.7 for _ in range(3)]


@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_converges_to_softmax_attention_as_features_grow(causal):
    q, k, v = _qkv()
    mask = torch.ones(24, 24, dtype=torch.bool).tril() if causal else None
    exact = eager_attention(q, k, v, mask)
    errors = []
    for m in (16, 256, 4096, 16384):
        trials = []
        for seed in range(3):
            w = orthogonal_features(m, 16, torch.Generator().manual_seed(seed))
            approx = favor_attention(q, k, v, w, causal=causal)
            trials.append(((approx - exact).norm() / exact.norm()).item())
        errors.append(sum(trials) / len(trials))
    assert errors[0] > errors[1] > errors[2] > errors[3]  # the estimate converges (slowly: ~m^-1/4 here)
    assert errors[3] < 0.12 and errors[0] > 5 * errors[3]


def test_padding_is_never_read_and_causal_equals_each_prefix():
    q, k, v = _qkv(1)
    w = orthogonal_features(64, 16, torch.Generator().manual_seed(0))
    valid = torch.arange(24)[None].expand(2, 24) < torch.tensor([[24], [15]])
    k_bad = torch.where(valid[:, None, :, None], k, torch.full_like(k, 50.0))
    padded = favor_attention(q, k_bad, v, w, key_valid=valid)
    alone = favor_attention(q[1:], k[1:, :, :15], v[1:, :, :15], w)
    torch.testing.assert_close(padded[1:], alone, rtol=1e-4, atol=1e-5)
    causal = favor_attention(q, k, v, w, causal=True)
    for t in (0, 7, 23):
        prefix = favor_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], w)
        # equal up to the stabiliser's tiny ε, whose weight depends on the keys' max
        torch.testing.assert_close(causal[:, :, t : t + 1], prefix, rtol=2e-3, atol=2e-4)


def test_the_attention_kernel_option():
    torch.manual_seed(0)
    attn = Attention(32, 2, kernel="performer", performer_features=8192)
    x = torch.randn(2, 10, 32) * 0.5
    inputs = AttentionInputs(mask=MaskSpec(causal=True))
    approx = attn(x, inputs)
    attn.kernel = "eager"
    exact = attn(x, inputs)
    assert ((approx - exact).norm() / exact.norm()) < 0.15
    attn.kernel = "performer"
    with pytest.raises(ValueError, match="performer kernel"):
        attn(x, AttentionInputs(mask=MaskSpec(causal=True, window=4)))


@pytest.mark.parametrize("n", [1, 50, 64, 150])
def test_chunked_causal_sums_equal_per_token_prefix_sums(n):
    """The chunkwise causal form gives the per-token prefix-sum formula (N·m·Dh memory) exactly."""
    from mmformer.nn.linear_attention import _causal_chunked

    g = torch.Generator().manual_seed(n)
    qf, kf = torch.rand(2, 3, n, 16, generator=g), torch.rand(2, 3, n, 16, generator=g)
    v = torch.randn(2, 3, n, 8, generator=g)
    kv = torch.cumsum(kf.unsqueeze(-1) * v.unsqueeze(-2), dim=-3)  # (B, H, N, m, Dh)
    norm = (qf * torch.cumsum(kf, dim=-2)).sum(-1, keepdim=True)
    want = (qf.unsqueeze(-2) @ kv).squeeze(-2) / norm
    torch.testing.assert_close(_causal_chunked(qf, kf, v, chunk=32), want, atol=1e-5, rtol=1e-5)
