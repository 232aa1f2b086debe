"""``build_backbone`` from nested configs: the same backbones, weight for weight and output for output, as
the flat keyword arguments it replaced (reference values computed with those, at commit 2fa3a66, before
the configs existed); the recipe's flat ``model.backbone`` keys map onto the configs to the same
backbones; a kernel's own options and the BigBird settings reach the kernel; and the per-forward mask
is built once in ``Backbone.forward`` for every layer, never by a layer."""

from __future__ import annotations

import hashlib

import pytest
import torch

from mmformer.components.backbones import BackboneConfig, build_transformer
from mmformer.models import (
    AttentionConfig,
    BigBirdConfig,
    BlockConfig,
    LongContextConfig,
    MlpConfig,
    PositionConfig,
    build_backbone,
)
from mmformer.nn import KVCache, MaskSpec, Tokens
from mmformer.nn.attention import AttentionInputs
from mmformer.nn.masks import bigbird_layout

A = AttentionConfig

NESTED = {
    "vit": dict(attention=A(4), mlp=MlpConfig(ratio=3.0), block=BlockConfig(drop_path=0.1, layer_scale=1e-5)),
    "llama": dict(
        attention=A(4, n_kv_heads=2, qkv_bias=False, proj_bias=False, qk_norm=True),
        mlp=MlpConfig(hidden=40, act="swiglu", bias=False),
        positions=PositionConfig("rope", rope_base=500.0),
        norm="rmsnorm",
        causal=True,
    ),
    "bert": dict(
        attention=A(4, attn_drop=0.1, proj_drop=0.1),
        mlp=MlpConfig(drop=0.1),
        block=BlockConfig("post"),
        norm_eps=1e-12,
    ),
    "decoder": dict(
        attention=A(4),
        mlp=MlpConfig(act="gelu_tanh"),
        positions=PositionConfig("alibi"),
        long_context=LongContextConfig(window=5),
        block=BlockConfig("cross", d_context=24),
        causal=True,
    ),
    "dit": dict(
        attention=A(4),
        positions=PositionConfig("t5", rel_buckets=8, rel_max_distance=16),
        block=BlockConfig("adaln", d_cond=16),
        final_norm=False,
    ),
    "conformer": dict(
        attention=A(4, proj_drop=0.1),
        mlp=MlpConfig(drop=0.1),
        positions=PositionConfig("toeplitz", rel_max_distance=8),
        block=BlockConfig("conformer", conv_kernel=5),
    ),
    "bigbird": dict(
        attention=A(4),
        positions=PositionConfig("rope", rope_axes=2),
        long_context=LongContextConfig(bigbird=BigBirdConfig(4, window=1, global_blocks=1, random_blocks=2)),
        causal=True,
        bidirectional_modalities=(1,),
    ),
    "performer": dict(
        attention=A(4, kernel="performer", performer_features=64, sdpa_backend="math"),
        mlp=MlpConfig(hidden=50, act="relu"),
    ),
}

# the same settings as flat recipe keys (``model.backbone``), with d_model=32, n_layers=2, n_heads=4
FLAT = {
    "vit": dict(drop_path=0.1, layer_scale=1e-5, mlp_ratio=3.0),
    "llama": dict(
        n_kv_heads=2,
        mlp_hidden=40,
        norm="rmsnorm",
        act="swiglu",
        qkv_bias=False,
        proj_bias=False,
        mlp_bias=False,
        qk_norm=True,
        causal=True,
        positions="rope",
        rope_base=500.0,
    ),
    "bert": dict(block="post", norm_eps=1e-12, drop=0.1, attn_drop=0.1),
    "decoder": dict(block="cross", causal=True, d_context=24, positions="alibi", window=5, act="gelu_tanh"),
    "dit": dict(
        block="adaln", d_cond=16, final_norm=False, positions="t5", rel_buckets=8, rel_max_distance=16
    ),
    "conformer": dict(block="conformer", conv_kernel=5, positions="toeplitz", rel_max_distance=8, drop=0.1),
    "bigbird": dict(
        causal=True,
        positions="rope",
        rope_axes=2,
        bigbird_block=4,
        bigbird_window=1,
        bigbird_global=1,
        bigbird_random=2,
        bidirectional=["image"],
    ),
    "performer": dict(
        attn_kernel="performer", performer_features=64, mlp_hidden=50, act="relu", sdpa_backend="math"
    ),
}

# Computed with the flat ``build_backbone(d_model=32, n_layers=2, n_heads=4, **old_kwargs)`` before the
# nested configs (torch.manual_seed(0) before building): state-dict keys and shapes (a digest, and their
# count), a fingerprint of every initial weight, and fingerprints of the outputs per kernel after every
# parameter was moved off its initial value (``_outputs``). Fingerprint: sum, linearly weighted sum, abs sum.
REFERENCE = {
    "vit": {
        "keys": ("93a969acdb46a2cf", 30),
        "weights": (157.547736, -5.316117, 487.818784),
        "auto": (-2.687716, 0.666155, 628.195699),
        "eager": (-2.687716, 0.666155, 628.195698),
        "flex": (-2.687716, 0.666155, 628.195698),
    },
    "llama": {
        "keys": ("7af3132cf771d054", 17),
        "weights": (188.274398, -10.778772, 412.750195),
        "auto": (16.148441, 17.490526, 624.650986),
        "eager": (16.148441, 17.490526, 624.650978),
        "flex": (16.148441, 17.490526, 624.650978),
        "cached": (15.36214, 7.271969, 211.180867),
    },
    "bert": {
        "keys": ("cd4f9792d046a8fe", 24),
        "weights": (124.526065, -38.866052, 519.628118),
        "auto": (-1.651722, 1.582688, 608.452192),
        "eager": (-1.651722, 1.582686, 608.452193),
        "flex": (-1.651722, 1.582686, 608.452193),
    },
    "decoder": {
        "keys": ("1a162acf8e7a4d67", 42),
        "weights": (227.603929, 4.083451, 729.135585),
        "auto": (6.57362, 0.529534, 614.26543),
        "eager": (6.573619, 0.529534, 614.265424),
        "flex": (6.573619, 0.529534, 614.265424),
        "cached": (1.610262, -1.401744, 210.612292),
    },
    "dit": {
        "keys": ("747d8fed1e3b38c7", 21),
        "weights": (2.536225, 0.070953, 392.54438),
        "auto": (21.488414, 11.607675, 625.68436),
        "eager": (21.488414, 11.607675, 625.68436),
        "flex": (21.488414, 11.607675, 625.68436),
    },
    "conformer": {
        "keys": ("eb75014149ffcf77", 69),
        "weights": (482.610921, 44.510698, 1777.304236),
        "auto": (0.989686, -0.347083, 619.326998),
        "eager": (0.989686, -0.347081, 619.327001),
        "flex": (0.989686, -0.347081, 619.327001),
    },
    "bigbird": {
        "keys": ("1b795a4c74b0b831", 26),
        "weights": (156.526065, -7.200638, 551.628118),
        "auto": (2.569856, 2.697883, 614.264223),
        "eager": (2.569855, 2.697884, 614.26422),
        "flex": (2.569855, 2.697884, 614.26422),
        "cached": (1.04199, 1.473176, 209.7871),
    },
    "performer": {
        "keys": ("84221c376e0e88bf", 26),
        "weights": (156.450004, 2.18586, 394.868646),
        "performer": (-3.835675, 1.11104, 618.075304),
    },
}


def _fingerprint(t: torch.Tensor) -> tuple[float, float, float]:
    t = t.detach().double().flatten()
    w = torch.linspace(-1, 1, t.numel(), dtype=torch.float64)
    return float(t.sum()), float((t * w).sum()), float(t.abs().sum())


def _inputs(name: str) -> tuple[Tokens, dict]:
    """``(2, 12)`` tokens, the second row padded after 9; RoPE over 2 axes and a 5-token image span for
    ``bigbird``; a conditioning vector for ``dit``; a padded 7-token context for ``decoder``."""
    g = torch.Generator().manual_seed(1)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 9:] = False
    x = torch.randn(2, 12, 32, generator=g)
    tokens = Tokens.from_embeddings(x, 0, valid=valid, n_pos_axes=2 if name == "bigbird" else 1)
    if name == "bigbird":
        tokens.modality[:, :5] = 1
    kw = {}
    if name == "dit":
        kw["cond"] = torch.randn(2, 16, generator=g)
    if name == "decoder":
        cvalid = torch.ones(2, 7, dtype=torch.bool)
        cvalid[1, 5:] = False
        kw["context"] = Tokens.from_embeddings(torch.randn(2, 7, 24, generator=g), 1, valid=cvalid)
    return tokens, kw


def _chunk(t: Tokens, a: int, b: int) -> Tokens:
    return Tokens(t.x[:, a:b], t.valid[:, a:b], t.positions[:, a:b], t.document[:, a:b], t.modality[:, a:b])


def _check(name: str, backbone) -> None:
    ref = REFERENCE[name]
    sd = backbone.state_dict()
    keys = ";".join(f"{k}:{tuple(v.shape)}" for k, v in sd.items())
    assert (hashlib.sha1(keys.encode()).hexdigest()[:16], len(sd)) == ref["keys"], "state-dict keys differ"
    weights = torch.cat([v.flatten().double() for v in sd.values()])
    assert _fingerprint(weights) == pytest.approx(ref["weights"], rel=1e-6, abs=1e-5)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in backbone.parameters():  # off the initial values (adaLN-Zero starts as the identity)
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    backbone.eval()
    tokens, kw = _inputs(name)
    with torch.no_grad():
        for kernel in [k for k in ("auto", "eager", "flex", "performer") if k in ref]:
            backbone.set_attn_kernel(kernel)
            assert _fingerprint(backbone(tokens, **kw)) == pytest.approx(ref[kernel], rel=1e-5, abs=1e-4), (
                kernel
            )
        if "cached" in ref:
            backbone.set_attn_kernel("auto")
            cache = KVCache()
            backbone(_chunk(tokens, 0, 8), cache=cache, **kw)
            out = backbone(_chunk(tokens, 8, 12), cache=cache, **kw)
            assert _fingerprint(out) == pytest.approx(ref["cached"], rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("name", list(NESTED))
def test_nested_configs_build_the_backbones_the_flat_arguments_built(name):
    torch.manual_seed(0)
    _check(name, build_backbone(32, 2, **NESTED[name]))


@pytest.mark.parametrize("name", ["llama", "decoder", "conformer", "bigbird", "performer"])
def test_flat_recipe_keys_map_onto_the_same_backbones(name):
    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=32, n_layers=2, n_heads=4, **FLAT[name])
    _check(name, build_transformer(cfg, None))


def _tokens(n: int = 10, d: int = 32) -> Tokens:
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, n - 2 :] = False
    return Tokens.from_embeddings(torch.randn(2, n, d), 0, valid=valid)


def test_kernel_options_and_bigbird_settings_reach_the_kernel():
    bigbird = BigBirdConfig(block=3, window=0, global_blocks=2, random_blocks=0)
    backbone = build_backbone(
        32,
        2,
        A(4, kernel="performer", performer_features=48, sdpa_backend="math"),
        long_context=LongContextConfig(window=4, bigbird=bigbird),
    )
    for block in backbone.blocks:
        assert (block.attn.performer_features, block.attn.sdpa_backend) == (48, "math")
    inputs = backbone.attention_inputs(_tokens(), None, None, None)
    assert inputs.mask.window == 4 and inputs.mask.sparse_block == 3
    layouts = inputs.mask.sparse_layout  # each layer's, each head's: ceil(10 / 3) blocks
    assert layouts.shape == (2, 4, 4, 4)
    for i in range(2):
        assert torch.equal(layouts[i], bigbird_layout(4, 0, 2, 0, seed=i, n_heads=4))
    with pytest.raises(ValueError, match="performer kernel"):  # FAVOR+ cannot take the sparse mask
        backbone(_tokens())
    backbone = build_backbone(32, 1, A(4, kernel="performer", performer_features=48))
    backbone(_tokens())
    assert backbone.blocks[0].attn._features.shape == (48, 8)  # (features, head width)
    # the recipe's flat keys reach the kernel the same way
    cfg = BackboneConfig(
        d_model=32, n_layers=1, n_heads=4, attn_kernel="performer", performer_features=24, bigbird_block=5
    )
    backbone = build_transformer(cfg, None)
    assert backbone.blocks[0].attn.performer_features == 24
    assert backbone.long_context.bigbird == BigBirdConfig(block=5)


def test_the_mask_is_built_once_per_forward_and_no_layer_writes_to_the_inputs(monkeypatch):
    backbone = build_backbone(
        32,
        3,
        A(4, kernel="eager"),
        positions=PositionConfig("alibi"),
        long_context=LongContextConfig(window=3),
        causal=True,
    )
    dense_calls, seen = [], []
    dense = MaskSpec.dense
    monkeypatch.setattr(
        MaskSpec, "dense", lambda self, *a, **k: dense_calls.append(1) or dense(self, *a, **k)
    )
    for block in backbone.blocks:
        block.attn.register_forward_pre_hook(lambda m, args: seen.append(args[1]))
    tokens = _tokens()
    backbone(tokens)
    assert len(dense_calls) == 1  # once for all three layers
    assert len(seen) == 3 and all(s is seen[0] for s in seen)  # one inputs object, read by every layer
    with pytest.raises(AttributeError):  # frozen: a layer cannot fill it in for the next one
        seen[0].kernel_mask = None
    prepared = seen[0].kernel_mask
    assert prepared.kernels == {"eager"} and (prepared.n_q, prepared.n_k) == (10, 10)
    expected = MaskSpec.from_tokens(tokens.valid, tokens.document, True, window=3).dense(10, 10)
    assert torch.equal(prepared.dense, expected)
    assert prepared.bias.shape == (2, 4, 10, 10)  # ALiBi, gathered once for every layer
    # a layer used alone builds its own forms for its call (and stores nothing)
    inputs = AttentionInputs(mask=MaskSpec(causal=True))
    backbone.blocks[0].attn(torch.randn(1, 5, 32), inputs)
    assert inputs.kernel_mask is None


def test_configs_reject_unknown_choices_and_impossible_values():
    with pytest.raises(ValueError, match="attention kernel"):
        A(4, kernel="flash")
    with pytest.raises(ValueError, match="n_kv_heads"):
        A(4, n_kv_heads=3)
    with pytest.raises(ValueError, match="performer_features"):
        A(4, performer_features=0)
    with pytest.raises(ValueError, match="activation"):
        MlpConfig(act="gelu_erf")
    with pytest.raises(ValueError, match="positions"):
        PositionConfig("rotary")
    with pytest.raises(ValueError, match="block"):
        BlockConfig("decoder")
    with pytest.raises(ValueError, match="window"):
        LongContextConfig(window=0)
    with pytest.raises(ValueError, match="random_blocks"):
        BigBirdConfig(4, random_blocks=-1)
    with pytest.raises(ValueError, match="drop_path"):
        BlockConfig(drop_path=1.0)
