"""Random Feature Attention (``kernel="rfa"``): converges to softmax attention over ℓ2-normalised queries
and keys at temperature σ as the features grow, its features estimate the Gaussian kernel of width σ,
causal equals each prefix alone, padding is never read, RFA-Gate equals its step-by-step recurrence and
is refused without a causal mask, and it runs inside ``Attention``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmformer.nn import Attention, AttentionInputs, MaskSpec
from mmformer.nn.kernels import build_kernel
from mmformer.nn.kernels.rfa import fourier_frequencies, random_fourier_features, rfa_attention


def _qkv(seed=0, n=24, d=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, n, d, generator=g) * 0.7 for _ in range(3)]


def _softmax_reference(q, k, v, sigma, causal=False):
    """What RFA estimates: softmax over normalised q, k with weights ∝ exp(q̂·k̂ / σ²) (RFA Eq. 4–5)."""
    scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2) / sigma**2
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


def _gated_loop(q, k, v, w, logits, valid=None):
    """RFA-Gate written as the paper's recurrence, one step at a time (§3.2)."""
    qf = random_fourier_features(F.normalize(q, dim=-1), w)
    kf = random_fourier_features(F.normalize(k, dim=-1), w)
    B, H, N, _ = q.shape
    s = torch.zeros(B, H, kf.shape[-1], v.shape[-1])
    z = torch.zeros(B, H, kf.shape[-1])
    out = torch.zeros_like(v)
    for t in range(N):
        g = torch.sigmoid(logits[:, :, t])[..., None]  # (B, H, 1)
        write = (1 - g) * kf[:, :, t]  # (B, H, 2D)
        if valid is not None:  # a padded step leaves the state as it is
            keep = valid[:, t, None, None]
            g = torch.where(keep, g, torch.ones_like(g))
            write = torch.where(keep, write, torch.zeros_like(write))
        s = g[..., None] * s + write[..., None] * v[:, :, t, None, :]
        z = g * z + write
        num = (qf[:, :, t, :, None] * s).sum(-2)
        den = (qf[:, :, t] * z).sum(-1, keepdim=True)
        out[:, :, t] = torch.where(den == 0, torch.zeros_like(num), num / den)
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sigma", [1.0, 0.7])
def test_converges_to_softmax_attention_as_features_grow(sigma, causal):
    q, k, v = _qkv()
    exact = _softmax_reference(q, k, v, sigma, causal)
    errors = []
    for m in (16, 256, 4096, 16384):
        trials = []
        for seed in range(3):
            approx = rfa_attention(q, k, v, fourier_frequencies(m, 16, sigma, seed), causal=causal)
            trials.append(((approx - exact).norm() / exact.norm()).item())
        errors.append(sum(trials) / len(trials))
    assert errors[0] > errors[1] > errors[2] > errors[3]  # Monte Carlo: ~m^-1/2
    assert errors[2] < (0.04 if sigma == 1.0 else 0.1) and errors[0] > 8 * errors[2]
    if sigma != 1.0:  # the other reading of the paper's σ (frequencies N(0, σ² I)) targets 1/σ: far off
        other = _softmax_reference(q, k, v, 1 / sigma, causal)
        assert (other - exact).norm() / exact.norm() > 10 * errors[3]


@pytest.mark.parametrize("sigma", [0.5, 2.0])
def test_features_estimate_the_gaussian_kernel_of_width_sigma(sigma):
    g = torch.Generator().manual_seed(1)
    x, y = F.normalize(torch.randn(2, 6, 8, generator=g), dim=-1)  # unit vectors, as RFA uses them
    w = fourier_frequencies(200_000, 8, sigma, seed=3)
    estimate = random_fourier_features(x, w) @ random_fourier_features(y, w).T  # (6, 6)
    kernel = torch.exp(-torch.cdist(x, y).square() / (2 * sigma**2))
    torch.testing.assert_close(estimate, kernel, atol=6e-3, rtol=0)
    # with unit norms exp(x·y / σ²) = exp(1/σ²) · kernel: the norm correction is a constant
    torch.testing.assert_close(torch.exp(x @ y.T / sigma**2), torch.exp(torch.tensor(1 / sigma**2)) * kernel)


@pytest.mark.parametrize("n", [24, 150])
def test_causal_equals_each_prefix_alone(n):
    q, k, v = _qkv(1, n=n)
    w = fourier_frequencies(64, 16, seed=0)
    causal = rfa_attention(q, k, v, w, causal=True)  # chunks of 64: 150 tokens cross two chunk borders
    for t in sorted({0, 7, 63, 64, n - 1}):
        if t < n:
            prefix = rfa_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], w)
            torch.testing.assert_close(causal[:, :, t : t + 1], prefix, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal, gated", [(False, False), (True, False), (True, True)])
def test_padding_is_never_read(causal, gated):
    q, k, v = _qkv(2, n=20)
    w = fourier_frequencies(64, 16, seed=0)
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[0, 13:] = False  # right padding
    valid[1, :5] = False  # left padding
    pad = ~valid[:, None, :, None]
    k_bad, v_bad = k.masked_fill(pad, float("nan")), v.masked_fill(pad, 1e4)
    logits = torch.randn(2, 2, 20, generator=torch.Generator().manual_seed(0)) * 2 if gated else None
    bad_logits = None if logits is None else logits.masked_fill(~valid[:, None, :], float("nan"))
    got = rfa_attention(q, k_bad, v_bad, w, causal=causal, key_valid=valid, gate_logits=bad_logits)
    assert torch.isfinite(got).all()

    def alone(row, keys, queries):  # the row's real keys only, as if the padding were never there
        sel = dict(gate_logits=None if logits is None else logits[row : row + 1, :, keys])
        qq = q[row : row + 1, :, queries]
        return rfa_attention(
            qq, k[row : row + 1, :, keys], v[row : row + 1, :, keys], w, causal=causal, **sel
        )

    if causal:
        torch.testing.assert_close(
            got[0:1, :, :13], alone(0, slice(0, 13), slice(0, 13)), rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(
            got[1:2, :, 5:], alone(1, slice(5, 20), slice(5, 20)), rtol=1e-4, atol=1e-5
        )
        assert (got[1, :, :5] == 0).all()  # queries before any real key read nothing
    else:
        torch.testing.assert_close(got[0:1], alone(0, slice(0, 13), slice(None)), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1:2], alone(1, slice(5, 20), slice(None)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [16, 64])
def test_gated_recurrence_equals_the_step_by_step_loop(chunk):
    q, k, v = _qkv(3, n=150)
    w = fourier_frequencies(32, 16, seed=1)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 2, 150, generator=g) * 3  # gates from ~0 to ~1, so decays span many scales
    logits[0, 0, 40:60] = 30.0  # g ≈ 1: the state carried unchanged across a chunk border
    logits[1, 1, 70:75] = -30.0  # g ≈ 0: the state forgotten
    valid = torch.ones(2, 150, dtype=torch.bool)
    valid[1, :9] = False
    valid[0, 100:120] = False  # padding inside the sequence (e.g. a masked span) is skipped too
    want = _gated_loop(q, k, v, w, logits, valid)
    got = rfa_attention(q, k, v, w, causal=True, key_valid=valid, gate_logits=logits, chunk=chunk)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_gate_is_refused_without_a_causal_mask():
    kernel = build_kernel("rfa", 2, 16, {"gate": True, "n_features": 8})
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="causal"):
        kernel(q, k, v, MaskSpec())
    with pytest.raises(ValueError, match="causal"):
        rfa_attention(q, k, v, fourier_frequencies(8, 16), gate_logits=torch.zeros(2, 2, 24))
    attn = Attention(32, 2, kernel="rfa", kernel_options={"gate": True})
    x = torch.randn(2, 6, 32)
    with pytest.raises(ValueError, match="causal"):
        attn(x, MaskSpec(valid=torch.ones(2, 6, dtype=torch.bool)))
    attn.kernel = "rfa"  # still refuses the rules it lacks, naming the kernels that have them
    with pytest.raises(ValueError, match="rfa kernel does not implement window"):
        attn(x, MaskSpec(causal=True, window=3))


@pytest.mark.parametrize("gate", [False, True])
def test_inside_attention_forward_and_backward(gate):
    torch.manual_seed(0)
    options = {"n_features": 64, "gate": gate}
    attn = Attention(32, 2, kernel="rfa", kernel_options=options)
    if gate:  # gates that differ by token and head
        torch.nn.init.normal_(attn.kernel_module.gate_weight, std=0.5)
    x = torch.randn(2, 10, 32, requires_grad=True)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 7:] = False
    mask = MaskSpec(causal=True, valid=valid)
    out = attn(x, AttentionInputs(mask=mask))
    # the same function written out: projections, the kernel, the output projection
    q, k, v = attn.qkv(x).view(2, 10, 3, 2, 16).permute(2, 0, 3, 1, 4)  # each (B, H, N, Dh)
    k, v = (t.masked_fill(~valid[:, None, :, None], 0.0) for t in (k, v))
    logits = None
    if gate:
        logits = (
            torch.einsum("bhnd,hd->bhn", k, attn.kernel_module.gate_weight)
            + attn.kernel_module.gate_bias[:, None]
        )
    w = fourier_frequencies(64, 16, seed=0)
    ref = rfa_attention(q, k, v, w, causal=True, key_valid=valid, gate_logits=logits)
    ref = attn.proj(ref.transpose(1, 2).reshape(2, 10, 32))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    out[valid].square().sum().backward()
    grads = [x.grad, attn.qkv.weight.grad] + ([attn.kernel_module.gate_weight.grad] if gate else [])
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    assert ("kernel_module.gate_weight" in attn.state_dict()) == gate  # the gate trains and is saved
    with torch.no_grad():  # bf16 weights: the frequencies stay float32, the output is bf16
        low = attn.to(torch.bfloat16)(x.detach().bfloat16(), mask)
    assert low.dtype == torch.bfloat16 and (low.float() - out).norm() / out.norm() < 0.05


def test_options_are_checked():
    with pytest.raises(ValueError, match="Did you mean 'n_features'"):
        Attention(32, 2, kernel="rfa", kernel_options={"n_feature": 64})
    with pytest.raises(ValueError, match="sigma"):
        Attention(32, 2, kernel="rfa", kernel_options={"sigma": 0.0})
