"""The block family: exact formulas, adaLN-Zero identity at init, and a forward/backward sweep."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmformer.models import (
    AttentionConfig,
    BlockConfig,
    LongContextConfig,
    MlpConfig,
    PositionConfig,
    build_backbone,
)
from mmformer.models.presets import PRESETS
from mmformer.nn import (
    AdaLNBlock,
    Attention,
    Block,
    CrossAttentionBlock,
    Mlp,
    PostNormBlock,
    SwiGLU,
    Tokens,
)

D = 16


def _attn(**kw):
    return Attention(D, 2, kernel="eager", **kw)


def test_pre_and_post_norm_formulas():
    torch.manual_seed(0)
    x = torch.randn(2, 5, D)
    pre = Block(D, _attn(), Mlp(D, 32))
    expected = x + pre.attn(pre.norm1(x))
    expected = expected + pre.mlp(pre.norm2(expected))
    torch.testing.assert_close(pre(x), expected)
    post = PostNormBlock(D, _attn(), Mlp(D, 32))
    expected = post.norm1(x + post.attn(x))
    expected = post.norm2(expected + post.mlp(expected))
    torch.testing.assert_close(post(x), expected)


def test_cross_attention_block_formula():
    torch.manual_seed(0)
    x, ctx = torch.randn(2, 5, D), torch.randn(2, 3, D)
    blk = CrossAttentionBlock(D, _attn(), Mlp(D, 32), _attn(cross=True))
    h = x + blk.attn(blk.norm1(x))
    h = h + blk.cross_attn(blk.norm_cross(h), context=ctx)
    torch.testing.assert_close(blk(x, context=ctx), h + blk.mlp(blk.norm2(h)))


def test_adaln_zero_starts_as_identity_and_then_conditions():
    torch.manual_seed(0)
    blk = AdaLNBlock(D, _attn(), Mlp(D, 32), d_cond=8)
    x, cond = torch.randn(2, 5, D), torch.randn(2, 8)
    torch.testing.assert_close(blk(x, cond=cond), x)
    nn.init.normal_(blk.adaLN_modulation[-1].weight, std=0.1)
    y1, y2 = blk(x, cond=cond), blk(x, cond=cond * 2)
    assert not torch.allclose(y1, x) and not torch.allclose(y1, y2)
    with pytest.raises(ValueError, match="needs a conditioning vector"):
        blk(x)


def test_swiglu_formula():
    torch.manual_seed(0)
    mlp = SwiGLU(D, 24)
    x = torch.randn(3, D)
    w_gate, w_up = mlp.fc1.weight.chunk(2)
    torch.testing.assert_close(mlp(x), (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ mlp.fc2.weight.T)


def test_layer_scale_and_drop_path():
    blk = Block(D, _attn(), Mlp(D, 32), layer_scale=1e-5, drop_path=0.5)
    assert torch.allclose(blk.ls1.gamma, torch.full((D,), 1e-5))
    x = torch.randn(64, 5, D)
    blk.eval()
    assert torch.equal(blk(x), blk(x))
    blk.train()
    torch.manual_seed(0)
    changed = (blk(x) - x).abs().amax(dim=(1, 2)) > 0
    assert 0 < changed.sum() < 64  # some samples dropped the branch, some kept it


FAMILIES = {  # build_backbone's settings beyond the size; "attention" beyond n_heads
    "vit": dict(),
    "gpt2": dict(causal=True, mlp=MlpConfig(act="gelu_tanh")),
    "llama": dict(
        attention=dict(n_kv_heads=1, qkv_bias=False, qk_norm=True),
        causal=True,
        norm="rmsnorm",
        mlp=MlpConfig(act="swiglu", bias=False),
        positions=PositionConfig("rope"),
    ),
    "bert": dict(block=BlockConfig("post"), norm_eps=1e-12),
    "decoder": dict(causal=True, block=BlockConfig("cross")),
    "dit": dict(block=BlockConfig("adaln", d_cond=12)),
    "vit_rope2d": dict(
        positions=PositionConfig("rope", rope_axes=2), block=BlockConfig(layer_scale=1e-5, drop_path=0.1)
    ),
    "alibi": dict(causal=True, positions=PositionConfig("alibi"), long_context=LongContextConfig(window=3)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_runs_forward_backward_without_nan(family):
    torch.manual_seed(0)
    size = PRESETS["debug"]
    settings = dict(FAMILIES[family])
    attention = AttentionConfig(size["n_heads"], **settings.pop("attention", {}))
    backbone = build_backbone(size["d_model"], size["n_layers"], attention, **settings)
    B, N = 2, 6
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[1, 4:] = False
    x = torch.randn(B, N, size["d_model"], requires_grad=True)
    grid = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij"), -1).view(1, N, 2)
    tokens = Tokens.from_embeddings(x, 1, valid=valid, positions=grid.expand(B, N, 2))
    kwargs = {}
    if family == "decoder":
        kwargs["context"] = Tokens.from_embeddings(torch.randn(B, 3, size["d_model"]), 2)
    if family == "dit":
        kwargs["cond"] = torch.randn(B, 12)
    out = backbone(tokens, **kwargs)
    assert out.shape == (B, N, size["d_model"])
    out[valid].square().mean().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in backbone.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "debug"])
def test_presets_have_standard_shapes(name):
    size = PRESETS[name]
    assert size["d_model"] % size["n_heads"] == 0
    assert size["d_model"] // size["n_heads"] == (80 if name == "huge" else 64)


def test_rope_model_in_bf16_matches_float32_at_positions_in_the_thousands():
    torch.manual_seed(0)
    model = build_backbone(
        64,
        2,
        AttentionConfig(2),
        mlp=MlpConfig(act="swiglu"),
        positions=PositionConfig("rope"),
        norm="rmsnorm",
        causal=True,
    ).eval()
    x = torch.randn(1, 16, 64)
    pos = (4080 + torch.arange(16)).view(1, 16, 1)
    with torch.no_grad():
        ref = model(Tokens.from_embeddings(x, 0, positions=pos))
        low = model.to(torch.bfloat16)(Tokens.from_embeddings(x.bfloat16(), 0, positions=pos)).float()
    assert (low - ref).norm() / ref.norm() < 2e-2


def test_decoder_backbone_never_reads_padded_context():
    torch.manual_seed(0)
    backbone = build_backbone(D, 2, AttentionConfig(2), block=BlockConfig("cross"), causal=True).eval()
    x = Tokens.from_embeddings(torch.randn(2, 4, D), 0)
    ctx_x = torch.randn(2, 5, D)
    valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    poisoned = ctx_x.clone()
    poisoned[1, 3:] = 1e3
    with torch.no_grad():
        clean = backbone(x, context=Tokens.from_embeddings(ctx_x, 2, valid=valid))
        dirty = backbone(x, context=Tokens.from_embeddings(poisoned, 2, valid=valid))
        cut = backbone(Tokens.from_embeddings(x.x[1:], 0), context=Tokens.from_embeddings(ctx_x[1:, :3], 2))
    torch.testing.assert_close(dirty, clean)
    torch.testing.assert_close(clean[1:], cut, atol=1e-5, rtol=1e-5)
