"""Attention-Free Transformer kernels (``aft_full``, ``aft_local``, ``aft_simple``): equal to the paper's
formula computed naively in float64, with and without causality, with padding and non-zero biases; AFT-local
with a window covering the sequence is AFT-full; causal kernels never read later tokens and no kernel reads
padding; the biases train and are saved through ``Attention`` and a backbone."""

from __future__ import annotations

import pytest
import torch

from mmformer.nn import Attention, MaskSpec
from mmformer.nn.kernels import build_kernel
from mmformer.nn.tokens import Tokens

B, H, N, DH = 2, 2, 12, 4
OPTIONS = {"aft_full": {"max_len": 16}, "aft_local": {"max_len": 16, "window": 3}, "aft_simple": {}}


def _masks():
    right = torch.ones(B, N, dtype=torch.bool)
    right[1, 9:] = False  # right padding
    left = torch.ones(B, N, dtype=torch.bool)
    left[0, :3] = False  # left padding: causal rows 0-2 of batch 0 read nothing
    dead = right.clone()
    dead[1] = False  # a row of the batch with no real key at all
    return {
        "full": MaskSpec(),
        "causal": MaskSpec(causal=True),
        "padding": MaskSpec(valid=right),
        "causal_left_padding": MaskSpec(causal=True, valid=left),
        "causal_right_padding": MaskSpec(causal=True, valid=right),
        "no_real_key": MaskSpec(valid=dead),
    }


MASKS = _masks()


def _qkv(seed=0, n=N, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, DH, generator=g) * scale for _ in range(3)]


def _kernel(name, seed=0, **options):
    kernel = build_kernel(name, H, DH, {**OPTIONS[name], **options})
    if name != "aft_simple":
        with torch.no_grad():  # non-zero biases: zero ones would hide a mix-up of rows and columns
            kernel.pos_bias.normal_(generator=torch.Generator().manual_seed(seed + 1))
    return kernel


def _naive(q, k, v, w, mask):
    """The formula (arXiv:2105.14103 §3) in float64: per channel, a softmax over the allowed keys of
    ``K_{t'} + w_{t,t'}`` weighting ``V_{t'}``, gated by ``σ(Q_t)``; 0 in rows without keys."""
    q, k, v, w = (t.double() for t in (q, k, v, w))
    n_q, n_k = q.shape[-2], k.shape[-2]
    allowed = mask.dense(n_q, n_k)[..., None]  # (B or 1, 1, Nq, Nk, 1)
    logits = k[:, :, None] + w[:n_q, :n_k, None]  # (B, H, Nq, Nk, Dh)
    logits = logits.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, dim=3).nan_to_num(0.0)  # rows without keys: all -inf → 0
    return torch.sigmoid(q) * (weights * v.double()[:, :, None]).sum(3)


def _local_as_full(kernel, n):
    """AFT-local's biases as the paper's ``T × T`` ``w'``: ``w`` inside ``|t − t'| < s``, 0 outside."""
    s = kernel.window
    t, tk = torch.arange(n)[:, None], torch.arange(n)[None, :]
    inside = (tk - t).abs() < s
    band = kernel.pos_bias.detach()[t, (tk - t + s - 1).clamp(0, 2 * s - 2)]
    return torch.where(inside, band, torch.zeros(()))


@pytest.mark.parametrize("name", list(MASKS))
def test_aft_full_equals_the_formula(name):
    q, k, v = _qkv()
    kernel = _kernel("aft_full")
    want = _naive(q, k, v, kernel.pos_bias.detach(), MASKS[name])
    torch.testing.assert_close(kernel(q, k, v, MASKS[name]).double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 5, 11])
@pytest.mark.parametrize("name", list(MASKS))
def test_aft_local_equals_the_formula(name, window):
    """Far keys (``|t − t'| ≥ window``) still count with ``w = 0``, as in the paper."""
    q, k, v = _qkv(1)
    kernel = _kernel("aft_local", window=window)
    want = _naive(q, k, v, _local_as_full(kernel, N), MASKS[name])
    torch.testing.assert_close(kernel(q, k, v, MASKS[name]).double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(MASKS))
def test_aft_local_with_a_window_covering_the_sequence_is_aft_full(name):
    q, k, v = _qkv(2)
    full = _kernel("aft_full", seed=2)
    local = build_kernel("aft_local", H, DH, {"max_len": 16, "window": N})
    s, t = N, torch.arange(16)[:, None]
    tk = t + torch.arange(2 * s - 1) - (s - 1)  # the key each band entry stands for
    with torch.no_grad():  # the same biases, in band layout
        local.pos_bias.copy_(full.pos_bias[t.expand_as(tk), tk.clamp(0, 15)])
    torch.testing.assert_close(local(q, k, v, MASKS[name]), full(q, k, v, MASKS[name]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(MASKS))
def test_aft_simple_equals_the_formula_without_biases(name):
    q, k, v = _qkv(3)
    want = _naive(q, k, v, torch.zeros(N, N), MASKS[name])
    got = _kernel("aft_simple")(q, k, v, MASKS[name])
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_causal_aft_simple_is_exact_for_keys_of_any_spread():
    """Log-space prefix sums: keys spread over ±300 (exp overflows float32 at 88.7) still give the formula,
    to the ~eps·|K| (here ≈ 2e-5) that log-space sums of such keys keep in float32."""
    q, k, v = _qkv(4)
    k = k * 100.0
    for mask in (MASKS["causal"], MASKS["causal_left_padding"]):
        got = _kernel("aft_simple")(q, k, v, mask)
        torch.testing.assert_close(
            got.double(), _naive(q, k, v, torch.zeros(N, N), mask), atol=1e-4, rtol=1e-4
        )


def test_aft_simple_is_permutation_equivariant():
    q, k, v = _qkv(5)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    kernel = _kernel("aft_simple")
    out = kernel(q, k, v, MaskSpec())
    permuted = kernel(q[:, :, perm], k[:, :, perm], v[:, :, perm], MaskSpec())
    torch.testing.assert_close(permuted, out[:, :, perm], atol=1e-6, rtol=1e-6)


def test_heads_are_a_split_of_channels():
    """AFT is per channel with one ``w`` for all: 2 heads of 4 channels equal 1 head of 8."""
    q, k, v = _qkv(6)
    kernel = _kernel("aft_full")
    merged = [t.transpose(1, 2).reshape(B, N, 1, H * DH).transpose(1, 2) for t in (q, k, v)]  # (B, 1, N, 8)
    out = kernel(q, k, v, MASKS["causal"]).transpose(1, 2).reshape(B, N, H * DH)
    one_head = kernel(*merged, MASKS["causal"]).transpose(1, 2).reshape(B, N, H * DH)
    torch.testing.assert_close(one_head, out)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_causal_kernels_never_read_later_tokens(name):
    q, k, v = (t.requires_grad_() for t in _qkv(7))
    kernel, mask, t0 = _kernel(name), MASKS["causal"], 6
    out = kernel(q, k, v, mask)
    later = [t.detach().clone() for t in (q, k, v)]
    for t in later:
        t[:, :, t0 + 1 :] = torch.randn_like(t[:, :, t0 + 1 :]) * 5.0
    changed = kernel(*later, mask)
    if name == "aft_simple":  # its log-space prefix sums take no statistic of later tokens
        assert torch.equal(changed[:, :, : t0 + 1], out[:, :, : t0 + 1])
    else:  # equal up to rounding: one key max per channel over the whole sequence is subtracted (detached)
        torch.testing.assert_close(changed[:, :, : t0 + 1], out[:, :, : t0 + 1], atol=1e-6, rtol=1e-6)
    grads = torch.autograd.grad(out[:, :, : t0 + 1].sum(), [q, k, v])
    for g in grads:
        assert (g[:, :, t0 + 1 :] == 0).all() and g[:, :, : t0 + 1].abs().sum() > 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_padding_is_never_read(name, causal):
    q, k, v = _qkv(8)
    mask = MaskSpec(causal=causal, valid=MASKS["padding"].valid)  # batch row 1: keys 9-11 are padding
    kernel = _kernel(name)
    k_bad, v_bad = k.clone().requires_grad_(), v.clone().requires_grad_()
    with torch.no_grad():
        k_bad[1, :, 9:], v_bad[1, :, 9:] = float("nan"), float("nan")
        k_bad[1, :, 10], v_bad[1, :, 11] = 1e30, -1e30
    dirty = kernel(q, k_bad, v_bad, mask)
    clean = kernel(q, k, v, mask)
    alone = kernel(q[1:, :, :9], k[1:, :, :9], v[1:, :, :9], MaskSpec(causal=causal))
    torch.testing.assert_close(dirty[:, :, :9], clean[:, :, :9])
    torch.testing.assert_close(dirty[1:, :, :9], alone, atol=1e-6, rtol=1e-6)
    dirty[:, :, :9].sum().backward()
    for g in (k_bad.grad, v_bad.grad):
        assert torch.isfinite(g).all() and (g[1, :, 9:] == 0).all()


def test_attention_layer_trains_and_saves_the_biases():
    torch.manual_seed(0)
    attn = Attention(32, 4, kernel="aft_full", kernel_options={"max_len": 16})
    x = torch.randn(2, 10, 32, requires_grad=True)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 7:] = False
    out = attn(x, MaskSpec(causal=True, valid=valid))
    assert out.shape == (2, 10, 32) and torch.isfinite(out).all()
    out.square().sum().backward()
    grad = attn.kernel_module.pos_bias.grad
    assert grad[:10, :10].abs().sum() > 0
    assert (grad[10:] == 0).all() and (grad[:, 10:] == 0).all()  # positions past the sequence: untouched
    assert (grad[:10, :10].triu(1) == 0).all()  # causal: the future's biases are never used
    assert attn.state_dict()["kernel_module.pos_bias"].shape == (16, 16)
    with torch.no_grad():  # bf16 runs too, in float32 inside
        low = attn.to(torch.bfloat16)(x.detach().bfloat16(), MaskSpec(causal=True, valid=valid))
    assert low.dtype == torch.bfloat16 and (low.float() - out.detach()).norm() / out.norm() < 2e-2


def test_backbone_with_aft_local_trains_saves_and_loads():
    from mmformer.models import AttentionConfig, build_backbone

    def backbone():
        config = AttentionConfig(4, kernel="aft_local", kernel_options={"max_len": 64, "window": 8})
        return build_backbone(32, 2, config)

    torch.manual_seed(0)
    model = backbone()
    for block in model.blocks:  # init_weights left them at 0 (all positions alike)
        assert (block.attn.kernel_module.pos_bias == 0).all()
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[0, 15:] = False
    tokens = Tokens.from_embeddings(torch.randn(2, 20, 32), 0, valid=valid)
    model(tokens).square().mean().backward()
    names = [f"blocks.{i}.attn.kernel_module.pos_bias" for i in range(2)]
    params = dict(model.named_parameters())
    for key in names:
        assert params[key].shape == (64, 15) and params[key].grad[:20].abs().sum() > 0
    with torch.no_grad():
        for key in names:
            params[key].normal_()
        out = model(tokens)
    restored = backbone()
    restored.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(restored(tokens), out)


def test_refusals():
    q, k, v = _qkv(9, n=20)
    with pytest.raises(ValueError, match="max_len=16"):
        _kernel("aft_full")(q, k, v, MaskSpec())
    with pytest.raises(ValueError, match="max_len=16"):
        Attention(32, 4, kernel="aft_local", kernel_options={"max_len": 16, "window": 4})(
            torch.randn(1, 20, 32)
        )
    with pytest.raises(ValueError, match="needs the option 'max_len'"):
        build_kernel("aft_full", H, DH, {})
    with pytest.raises(ValueError, match="needs the option 'window'"):
        build_kernel("aft_local", H, DH, {"max_len": 8})
    with pytest.raises(ValueError, match="Did you mean 'max_len'"):
        build_kernel("aft_full", H, DH, {"max_length": 8})
    with pytest.raises(ValueError, match="has no option"):
        build_kernel("aft_simple", H, DH, {"max_len": 8})
    span = torch.zeros(B, N, dtype=torch.long)
    span[:, :4] = 1
    for name in OPTIONS:
        with pytest.raises(ValueError, match=f"the {name} kernel does not implement spans"):
            _kernel(name).check(MaskSpec(causal=True, span=span))
    attn = Attention(32, 4, kernel="aft_simple")
    with pytest.raises(ValueError, match="does not implement spans"):
        attn(torch.randn(B, N, 32), MaskSpec(causal=True, span=span))
    with pytest.raises(ValueError, match="self-attention only"):
        _kernel("aft_local")(q[:, :, :5], k[:, :, :8], v[:, :, :8], MaskSpec())
