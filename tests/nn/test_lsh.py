"""LSH attention (Reformer §3): with every token in one chunk it equals dense shared-QK softmax attention (self
masked) — causal, padded, shorter than a chunk; with one bucket it equals chunked local attention at an
indivisible length; several hash rounds equal softmax over the union of their chunks; sorting is undone
exactly; causal attention never reads a later token and padding is never read; it runs in ``Attention`` and a
backbone, and refuses unknown options and masks it does not implement."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mmformer.models import AttentionConfig, build_backbone
from mmformer.nn import Attention, MaskSpec
from mmformer.nn.kernels import build_kernel
from mmformer.nn.kernels.lsh import hash_buckets, sort_by_bucket, take
from mmformer.nn.tokens import Tokens

B, H, DH = 2, 2, 16


def _qv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, DH, generator=g) * 2, torch.randn(B, H, n, DH, generator=g)


def _valid(n, right=0, left=0):
    """Row 0 all real; row 1 with ``left`` padded tokens first and ``right`` last."""
    valid = torch.ones(B, n, dtype=torch.bool)
    valid[1, :left] = False
    valid[1, n - right :] = False
    return valid


def reference(q, v, allowed):
    """Dense shared-QK attention: keys = queries at length √Dh, scores q·k/√Dh, a token's score for itself
    −1e5 (read only when nothing else is allowed), ``allowed (B or 1, H or 1, N, N)`` bool; empty rows → 0."""
    k = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + 1e-6)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.eye(q.shape[-2], dtype=torch.bool), -1e5)
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0) @ v


def dense_allowed(n, causal=False, valid=None, chunk_of=None):
    """``(B or 1, H or 1, N, N)``: causal order, real keys, and (``chunk_of (B, H, R, N)``) keys in the query's
    chunk or the one before in at least one round."""
    allowed = torch.ones(1, 1, n, n, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
    if valid is not None:
        allowed = allowed & valid[:, None, None, :]
    if chunk_of is not None:
        d = chunk_of[..., :, None] - chunk_of[..., None, :]  # (B, H, R, N, N)
        allowed = allowed & ((d == 0) | (d == 1)).any(dim=2)
    return allowed


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_one_chunk_equals_dense_shared_qk_attention(causal, padded):
    """N = 24 < chunk_size: every token is in one chunk, whatever the buckets, in each of 3 rounds."""
    q, v = _qv(24)
    valid = _valid(24, right=5, left=2) if padded else None
    lsh = build_kernel("lsh", H, DH, {"n_buckets": 8, "n_hashes": 3, "chunk_size": 64})
    got = lsh(q, None, v, MaskSpec(causal=causal, valid=valid))
    want = reference(q, v, dense_allowed(24, causal, valid))
    rows = torch.ones(B, 24, dtype=torch.bool) if valid is None else valid  # padded queries' output is free
    torch.testing.assert_close(got.transpose(1, 2)[rows], want.transpose(1, 2)[rows], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()
    if causal:  # the first token has only itself to read
        torch.testing.assert_close(got[0, :, 0], v[0, :, 0])


@pytest.mark.parametrize("padded", [False, True], ids=["full", "right_padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_one_bucket_equals_chunked_local_attention_at_an_indivisible_length(causal, padded):
    """One bucket keeps the original order: token i reads the tokens of chunk i // 8 and the chunk before;
    N = 37 is padded to 40 inside the kernel."""
    q, v = _qv(37, 1)
    valid = _valid(37, right=7) if padded else None  # right padding sorts last, where it already is
    lsh = build_kernel("lsh", H, DH, {"n_buckets": 1, "chunk_size": 8})
    got = lsh(q, None, v, MaskSpec(causal=causal, valid=valid))
    chunk_of = (torch.arange(37) // 8).view(1, 1, 1, 37)
    want = reference(q, v, dense_allowed(37, causal, valid, chunk_of))
    rows = torch.ones(B, 37, dtype=torch.bool) if valid is None else valid
    torch.testing.assert_close(got.transpose(1, 2)[rows], want.transpose(1, 2)[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_several_rounds_equal_softmax_over_the_union_of_their_chunks(causal):
    """3 rounds of 4 buckets, chunks of 8, N = 37, left padding: the log-sum-exp combination with the
    ``− log N_ij`` correction is exactly softmax attention over every key any round put in reach."""
    q, v = _qv(37, 2)
    valid = _valid(37, left=6)
    lsh = build_kernel("lsh", H, DH, {"n_buckets": 4, "n_hashes": 3, "chunk_size": 8})
    got = lsh(q, None, v, MaskSpec(causal=causal, valid=valid))
    # the kernel's chunks, from its hash: padded tokens (and the 3 filling 37 up to 40) sort last
    keep = F.pad(valid, (0, 3), value=False)
    q_padded = F.pad(q, (0, 0, 0, 3)).masked_fill(~keep[:, None, :, None], 0.0)
    buckets = hash_buckets(q_padded, lsh.rotations).masked_fill(~keep[:, None, None, :], 4)
    chunk_of = (sort_by_bucket(buckets)[1] // 8)[..., :37]  # (B, H, 3, N): each token's chunk per round
    allowed = dense_allowed(37, causal, valid, chunk_of)
    want = reference(q, v, allowed)
    torch.testing.assert_close(got.transpose(1, 2)[valid], want.transpose(1, 2)[valid], atol=1e-5, rtol=1e-5)
    # the case is not trivial: many pairs are out of reach, and some pairs meet in several rounds
    d = chunk_of[..., :, None] - chunk_of[..., None, :]
    every = dense_allowed(37, causal, valid).expand_as(allowed)
    assert allowed.sum() < 0.9 * every.sum() and (((d == 0) | (d == 1)).sum(2) > 1).any()
    assert len(buckets.unique()) == 5  # every bucket used, plus padding's


def test_sorting_then_unsorting_is_the_identity():
    g = torch.Generator().manual_seed(0)
    buckets = torch.randint(0, 5, (2, 3, 2, 50), generator=g)
    order, undo = sort_by_bucket(buckets)
    x = torch.randn(2, 3, 2, 50, 4, generator=g)
    assert torch.equal(take(take(x, order), undo), x)
    assert torch.equal(order.gather(-1, undo), torch.arange(50).expand(2, 3, 2, 50))
    key = buckets.gather(-1, order) * 50 + order  # sorted by bucket, then by position
    assert (key.diff(dim=-1) > 0).all()


def test_hash_is_angular_lsh_with_one_rotation_per_round_and_head():
    lsh = build_kernel("lsh", H, DH, {"n_buckets": 6, "n_hashes": 2, "seed": 3})
    assert lsh.rotations.shape == (2, H, DH, 3)
    x = torch.randn(1, H, 40, DH)
    buckets = hash_buckets(x, lsh.rotations)
    rot = torch.einsum("hnd,hdk->hnk", x[0], lsh.rotations[1])  # round 1 by hand
    assert torch.equal(buckets[0, :, 1], torch.cat([rot, -rot], -1).argmax(-1))
    assert torch.equal(hash_buckets(x * 7.5, lsh.rotations), buckets)  # angular: the length does not matter
    assert torch.equal(hash_buckets(-x, lsh.rotations), (buckets + 3) % 6)  # antipodes 3 buckets apart
    again = build_kernel("lsh", H, DH, {"n_buckets": 6, "n_hashes": 2, "seed": 3})
    assert torch.equal(again.rotations, lsh.rotations)  # the seed fixes the hash


def test_causal_never_reads_a_later_token():
    q, v = _qv(37, 3)
    lsh = build_kernel("lsh", H, DH, {"n_buckets": 4, "n_hashes": 2, "chunk_size": 8})
    mask = MaskSpec(causal=True)
    out = lsh(q, None, v, mask)
    t = 20
    v_later = v.clone()
    v_later[:, :, t + 1 :] = torch.randn(B, H, 37 - t - 1, DH) * 100
    assert torch.equal(lsh(q, None, v_later, mask)[:, :, : t + 1], out[:, :, : t + 1])
    q.requires_grad_(True)
    v.requires_grad_(True)
    lsh(q, None, v, mask)[:, :, t].square().sum().backward()
    assert (q.grad[:, :, t + 1 :] == 0).all() and (v.grad[:, :, t + 1 :] == 0).all()
    assert q.grad[:, :, : t + 1].abs().sum() > 0 and v.grad[:, :, :t].abs().sum() > 0  # t reads others


@pytest.mark.parametrize("garbage", ["finite", "nan"])
def test_padding_is_never_read_and_empty_rows_are_zero(garbage):
    q, v = _qv(37, 4)
    valid = _valid(37, right=9, left=4)
    lsh = build_kernel("lsh", H, DH, {"n_buckets": 4, "n_hashes": 2, "chunk_size": 8})
    mask = MaskSpec(causal=True, valid=valid)
    clean = lsh(q, None, v, mask)
    bad_q, bad_v = q.clone(), v.clone()
    pad = ~valid[:, None, :, None].expand_as(q)
    fill = torch.full_like(q, float("nan")) if garbage == "nan" else torch.randn_like(q) * 1e4
    bad_q[pad], bad_v[pad] = fill[pad], fill[pad]
    dirty = lsh(bad_q, None, bad_v, mask)
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[1, :, 4:28], clean[1, :, 4:28])
    assert torch.isfinite(dirty).all()
    # a row with no real key at all: zeros, and finite gradients
    dead = torch.zeros(B, 37, dtype=torch.bool)
    dead[0] = True
    q.requires_grad_(True)
    out = lsh(q, None, v, MaskSpec(causal=True, valid=dead))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_through_attention_equals_dense_shared_qk_and_leaves_the_key_projection_unused():
    torch.manual_seed(0)
    attn = Attention(32, 4, kernel="lsh", kernel_options={"n_buckets": 4, "n_hashes": 2, "chunk_size": 16})
    x = torch.randn(2, 10, 32, requires_grad=True)  # 10 < chunk_size: one chunk
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 7:] = False
    mask = MaskSpec(causal=True, valid=valid)
    out = attn(x, mask)
    q, _, v = attn._project(x, None)
    want = reference(q, v, dense_allowed(10, True, valid)).transpose(1, 2).reshape(2, 10, 32)
    torch.testing.assert_close(out[valid], attn.proj(want)[valid], atol=1e-5, rtol=1e-5)
    out[valid].square().sum().backward()
    g = attn.qkv.weight.grad  # rows: q (32), k (32), v (32)
    assert (g[32:64] == 0).all() and g[:32].abs().sum() > 0 and g[64:].abs().sum() > 0
    attn.eval()  # the same hash in eval
    with torch.no_grad():
        torch.testing.assert_close(attn(x, mask), out, atol=0, rtol=0)
        assert attn.to(torch.bfloat16)(x.bfloat16(), mask).dtype == torch.bfloat16  # float32 inside


def test_backbone_trains_and_ignores_padding():
    torch.manual_seed(0)
    config = AttentionConfig(4, kernel="lsh", kernel_options={"n_buckets": 4, "chunk_size": 8})
    backbone = build_backbone(32, 2, config, causal=True)
    x = torch.randn(2, 37, 32)
    valid = _valid(37, right=5)
    out = backbone(Tokens.from_embeddings(x, 0, valid=valid))
    poisoned = x.clone()
    poisoned[1, 32:] = 1e3
    dirty = backbone(Tokens.from_embeddings(poisoned, 0, valid=valid))
    torch.testing.assert_close(dirty[valid], out[valid], atol=0, rtol=0)
    out[valid].square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in backbone.parameters())
    assert backbone.blocks[0].attn.qkv.weight.grad[:32].abs().sum() > 0  # through the shared queries/keys


def test_unknown_and_invalid_options_are_refused():
    with pytest.raises(ValueError, match="Did you mean 'n_buckets'"):
        AttentionConfig(4, kernel="lsh", kernel_options={"num_buckets": 4})
    with pytest.raises(ValueError, match="Did you mean 'chunk_size'"):
        Attention(32, 4, kernel="lsh", kernel_options={"chunk_length": 8})
    with pytest.raises(ValueError, match="Did you mean 'n_hashes'"):
        build_kernel("lsh", 4, 8, {"num_hashes": 2})
    with pytest.raises(ValueError, match="1 or a positive even number"):
        build_kernel("lsh", 4, 8, {"n_buckets": 3})
    with pytest.raises(ValueError, match=">= 1"):
        build_kernel("lsh", 4, 8, {"chunk_size": 0})


def test_masks_it_does_not_implement_are_refused_naming_the_kernels_that_do():
    prefix = torch.zeros(2, 10, dtype=torch.long)
    prefix[:, :4] = 1  # prefix-LM span
    span_mask = MaskSpec(causal=True, span=prefix)
    lsh = build_kernel("lsh", 4, 8)
    with pytest.raises(ValueError, match="not implement spans masks.*kernels that do: eager, sdpa, flex"):
        lsh.check(span_mask)
    attn = Attention(32, 4, kernel="lsh")
    with pytest.raises(ValueError, match="kernels that do: eager, sdpa, flex"):
        attn(torch.randn(2, 10, 32), span_mask)
    with pytest.raises(ValueError, match="window"):
        attn(torch.randn(2, 10, 32), MaskSpec(causal=True, window=3))
    with pytest.raises(ValueError, match="shared-QK self-attention: 5 queries but 7"):
        lsh(torch.randn(1, 4, 5, 8), None, torch.randn(1, 4, 7, 8), MaskSpec())
