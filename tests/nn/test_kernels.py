"""Every kernel equals the eager reference for every mask kind (forward; gradients for sdpa), with
padded and fully masked rows, GQA and ALiBi; flex runs forward-only on CPU (its gradients are checked
by bench/gpu_check.py)."""

import pytest
import torch

from mmformer.nn import Attention, AttentionInputs, MaskSpec
from mmformer.nn.positions import alibi_slopes

B, N, D, H = 2, 12, 32, 4


def _masks():
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[1, 9:] = False  # right padding
    left = torch.ones(B, N, dtype=torch.bool)
    left[0, :3] = False  # left padding
    doc = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 12])
    prefix = torch.zeros(B, N, dtype=torch.long)
    prefix[:, :4] = 1  # prefix-LM: the first 4 tokens see each other both ways
    spans = torch.tensor([[0, 1, 1, 1, 0, 0, 2, 2, 0, 0, 0, 0], [0, 0, 3, 3, 3, 3, 0, 0, 0, 0, 0, 0]])
    dead = valid.clone()
    dead[1] = False  # a row with no real key at all
    return {
        "full": MaskSpec(),
        "causal": MaskSpec(causal=True),
        "padding": MaskSpec(valid=valid),
        "left_padding_causal": MaskSpec(causal=True, valid=left),
        "documents": MaskSpec(causal=True, document=doc),
        "prefix_lm": MaskSpec(causal=True, span=prefix, valid=valid),
        "modality_spans": MaskSpec(causal=True, span=spans),
        "window": MaskSpec(causal=True, window=3),
        "window_bidirectional": MaskSpec(window=2, valid=valid),
        "fully_masked": MaskSpec(valid=dead),
    }


MASKS = _masks()


def _attn(kernel, **kw):
    torch.manual_seed(0)
    return Attention(D, H, kernel=kernel, **kw)


def _inputs(mask, alibi=False):
    if not alibi:
        return AttentionInputs(mask=mask)
    pos = torch.arange(N).expand(B, N)
    return AttentionInputs(mask=mask, alibi_slopes=alibi_slopes(H), q_pos=pos, k_pos=pos)


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@pytest.mark.parametrize("name", list(MASKS))
def test_kernel_forward_equals_eager_fp32(name, kernel, alibi):
    x = torch.randn(B, N, D)
    ref, other = _attn("eager"), _attn(kernel)
    with torch.no_grad():
        expected = ref(x, _inputs(MASKS[name], alibi))
        got = other(x, _inputs(MASKS[name], alibi))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@pytest.mark.parametrize("name", ["causal", "padding", "documents", "prefix_lm"])
def test_kernel_forward_equals_eager_bf16(name, kernel):
    x = torch.randn(B, N, D)
    ref = _attn("eager")
    other = _attn(kernel).to(torch.bfloat16)
    with torch.no_grad():
        expected = ref(x, MASKS[name])
        got = other(x.bfloat16(), MASKS[name]).float()
    assert (got - expected).norm() / expected.norm() < 1e-2


@pytest.mark.parametrize("name", list(MASKS))
def test_sdpa_gradients_equal_eager(name):
    x = torch.randn(B, N, D, requires_grad=True)
    ref, other = _attn("eager"), _attn("sdpa")
    g_ref = torch.autograd.grad(ref(x, MASKS[name]).square().sum(), [x, *ref.parameters()])
    g_sdpa = torch.autograd.grad(other(x, MASKS[name]).square().sum(), [x, *other.parameters()])
    for a, b in zip(g_sdpa, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        assert torch.isfinite(a).all()


@pytest.mark.parametrize("kernel", ["eager", "sdpa", "flex"])
def test_garbage_in_padded_keys_changes_nothing(kernel):
    mask = MASKS["padding"]
    attn = _attn(kernel)
    x = torch.randn(B, N, D)
    poisoned = x.clone()
    poisoned[1, 9:] = float("nan")
    poisoned[1, 10] = 1e30
    with torch.no_grad():
        clean, dirty = attn(x, mask), attn(poisoned, mask)
    torch.testing.assert_close(dirty[1, :9], clean[1, :9])
    torch.testing.assert_close(dirty[0], clean[0])


def test_gqa_and_mqa_equal_eager_in_every_kernel():
    x = torch.randn(B, N, D)
    for n_kv in (2, 1):
        ref, sdpa, flex = (_attn(k, n_kv_heads=n_kv) for k in ("eager", "sdpa", "flex"))
        with torch.no_grad():
            expected = ref(x, MASKS["documents"])
            torch.testing.assert_close(sdpa(x, MASKS["documents"]), expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(flex(x, MASKS["documents"]), expected, atol=1e-5, rtol=1e-5)


def test_flex_refuses_gradients_on_cpu_with_a_clear_message():
    x = torch.randn(B, N, D, requires_grad=True)
    with pytest.raises(ValueError, match="no backward pass on CPU"):
        _attn("flex")(x, MASKS["causal"])


def test_auto_is_sdpa_on_cpu_and_trains():
    attn = _attn("auto")
    x = torch.randn(B, N, D, requires_grad=True)
    inputs = AttentionInputs(mask=MASKS["documents"])
    assert attn.resolve_kernel(x, inputs) == "sdpa"
    attn(x, inputs).sum().backward()
    assert x.grad is not None


def test_attention_dropout_only_in_training():
    attn = _attn("sdpa", attn_drop=0.5)
    x = torch.randn(B, N, D)
    attn.eval()
    assert torch.equal(attn(x), attn(x))
    attn.train()
    assert not torch.equal(attn(x), attn(x))


def test_qk_norm_normalises_each_head():
    attn = _attn("eager", qk_norm=True)
    q, k, _ = attn._project(torch.randn(B, N, D) * 100, None)
    assert torch.allclose(q.pow(2).mean(-1), torch.ones(()), atol=1e-3)
    assert torch.allclose(k.pow(2).mean(-1), torch.ones(()), atol=1e-3)


def test_cross_attention_reads_only_real_context_tokens():
    torch.manual_seed(0)
    attn = Attention(D, H, cross=True, d_context=16, kernel="sdpa")
    x, ctx = torch.randn(B, 5, D), torch.randn(B, 7, 16)
    valid = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    inputs = AttentionInputs(context_mask=MaskSpec(valid=valid))
    out = attn(x, inputs, context=ctx)
    ctx2 = ctx.clone()
    ctx2[1, 4:] = 1e4
    torch.testing.assert_close(attn(x, inputs, context=ctx2), out)
    alone = attn(x[1:], context=ctx[1:, :4])  # the same row with its padding cut off
    torch.testing.assert_close(out[1:], alone, atol=1e-5, rtol=1e-5)
