"""Attention kernels against the eager reference and torch.nn.MultiheadAttention."""

import pytest
import torch
from torch import nn

from mmformer.nn import Attention, MaskSpec
from mmformer.nn.masks import to_ignore


def _pair(**kw):
    torch.manual_seed(0)
    a = Attention(32, 4, kernel="eager", **kw)
    b = Attention(32, 4, kernel="sdpa", **kw)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_equals_eager_with_padding(causal):
    a, b = _pair()
    x = torch.randn(3, 9, 32)
    valid = torch.ones(3, 9, dtype=torch.bool)
    valid[1, 6:] = False
    valid[2, 3:] = False
    mask = MaskSpec(causal=causal, valid=valid)
    torch.testing.assert_close(b(x, mask), a(x, mask), atol=1e-5, rtol=1e-5)


def test_sdpa_gradients_equal_eager():
    a, b = _pair()
    x = torch.randn(2, 7, 32, requires_grad=True)
    valid = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.bool)
    ga = torch.autograd.grad(a(x, MaskSpec(valid=valid)).sum(), [x, *a.parameters()])
    gb = torch.autograd.grad(b(x, MaskSpec(valid=valid)).sum(), [x, *b.parameters()])
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_padded_keys_change_nothing(kernel):
    torch.manual_seed(0)
    attn = Attention(32, 4, kernel=kernel)
    x = torch.randn(1, 5, 32)
    valid = torch.tensor([[True, True, True, False, False]])
    out = attn(x, MaskSpec(valid=valid))
    x2 = x.clone()
    x2[:, 3:] = 1e4  # garbage in padded positions
    out2 = attn(x2, MaskSpec(valid=valid))
    torch.testing.assert_close(out[:, :3], out2[:, :3], atol=1e-5, rtol=1e-5)
    ref = attn(x[:, :3])  # the unpadded sequence alone
    torch.testing.assert_close(out[:, :3], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_fully_masked_rows_are_zero_not_nan(kernel):
    attn = Attention(32, 4, kernel=kernel, qkv_bias=False)
    nn.init.zeros_(attn.proj.bias)
    x = torch.randn(2, 4, 32)
    valid = torch.tensor([[True] * 4, [False] * 4])
    out = attn(x, MaskSpec(valid=valid))
    assert torch.isfinite(out).all()
    assert out[1].abs().max() == 0


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_gqa_equals_explicitly_repeated_heads(kernel):
    torch.manual_seed(0)
    gqa = Attention(32, 4, n_kv_heads=2, kernel=kernel)
    full = Attention(32, 4, kernel="eager")
    head_dim = 8

    def repeat(t):  # (2 kv heads · head_dim, …) → (4 heads · head_dim, …): each kv head serves 2 q heads
        return t.view(2, head_dim, *t.shape[1:]).repeat_interleave(2, dim=0).reshape(32, *t.shape[1:])

    qw, kw, vw = gqa.qkv.weight.data.split([32, 16, 16])
    qb, kb, vb = gqa.qkv.bias.data.split([32, 16, 16])
    full.qkv.weight.data = torch.cat([qw, repeat(kw), repeat(vw)])
    full.qkv.bias.data = torch.cat([qb, repeat(kb), repeat(vb)])
    full.proj.load_state_dict(gqa.proj.state_dict())
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(gqa(x), full(x), atol=1e-5, rtol=1e-5)


def test_equals_torch_multihead_attention():
    torch.manual_seed(0)
    ours = Attention(32, 4, kernel="sdpa")
    ref = nn.MultiheadAttention(32, 4, batch_first=True)
    ref.in_proj_weight.data.copy_(ours.qkv.weight.data)
    ref.in_proj_bias.data.copy_(ours.qkv.bias.data)
    ref.out_proj.load_state_dict(ours.proj.state_dict())
    x = torch.randn(2, 5, 32)
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    expected, _ = ref(x, x, x, key_padding_mask=to_ignore(valid), need_weights=False)
    torch.testing.assert_close(ours(x, MaskSpec(valid=valid)), expected, atol=1e-5, rtol=1e-5)


def test_causal_mask_dense_matches_tril():
    m = MaskSpec(causal=True).dense(4)
    assert torch.equal(m[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())


def test_document_mask_is_block_diagonal():
    doc = torch.tensor([[0, 0, 1, 1, 1]])
    m = MaskSpec(document=doc).dense(5)[0, 0]
    assert m[0, 1] and not m[1, 2] and m[2, 4] and not m[4, 0]


def test_eval_mode_dropout_is_deterministic():
    attn = Attention(32, 4, attn_drop=0.5, proj_drop=0.5).eval()
    x = torch.randn(2, 5, 32)
    assert torch.equal(attn(x), attn(x))


def test_causal_fast_path_equals_eager():
    a, b = _pair()
    x = torch.randn(2, 7, 32)
    torch.testing.assert_close(b(x, MaskSpec(causal=True)), a(x, MaskSpec(causal=True)), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(b(x, MaskSpec(causal=True)), b(x))  # the mask did something


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_fully_masked_rows_have_finite_gradients(kernel):
    attn = Attention(32, 4, kernel=kernel)
    x = torch.randn(2, 4, 32, requires_grad=True)
    valid = torch.tensor([[True] * 4, [False] * 4])
    attn(x, MaskSpec(valid=valid)).sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in attn.parameters())


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'"):
        Attention(32, 4, kernel="flash")
    attn = Attention(32, 4)
    with pytest.raises(ValueError, match="unknown attention kernel"):
        attn.kernel = "flex2"


def test_eager_keeps_float64_inputs_in_float64():
    from mmformer.nn.attention import eager_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    want = torch.softmax(q @ k.transpose(-1, -2) / 2, -1) @ v  # Dh ** -0.5 = 1 / 2
    got = eager_attention(q, k, v, None)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
