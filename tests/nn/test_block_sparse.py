"""BigBird block-sparse attention: the layout has its band, global and random blocks; eager, sdpa
(dense mask) and flex (block mask) kernels agree on it; a backbone with it trains and decodes."""

from __future__ import annotations

import torch

from mmformer.models import AttentionConfig, BigBirdConfig, LongContextConfig, PositionConfig, build_backbone
from mmformer.nn.attention import Attention, AttentionInputs
from mmformer.nn.masks import MaskSpec, bigbird_layout
from mmformer.nn.tokens import Tokens


def test_layout_has_band_global_and_random_blocks():
    layout = bigbird_layout(12, window=1, global_blocks=2, random_blocks=2, seed=3)
    assert layout[:2].all() and layout[:, :2].all()  # global blocks read and are read by all
    for i in range(12):
        assert layout[i, max(0, i - 1) : i + 2].all()  # the band
    for i in range(2, 12):
        band = {j for j in range(max(0, i - 1), min(12, i + 2))} | {0, 1}
        assert int(layout[i].sum()) == len(band) + 2  # exactly 2 random blocks beyond band and global
    assert torch.equal(layout, bigbird_layout(12, 1, 2, 2, seed=3))  # seeded
    assert bigbird_layout(64, 1, 2, 2).float().mean() < 0.15  # cost linear in length: sparse


def test_causal_layout_draws_random_blocks_from_the_past_and_keeps_every_prefix():
    full = bigbird_layout(16, window=1, global_blocks=1, random_blocks=2, seed=5, causal=True)
    for i in range(4, 16):  # two random blocks, each earlier than the band
        assert int(full[i, : i - 1].sum()) == 3  # the global block and two random ones
    for n in range(1, 16):  # a row's pattern never depends on the blocks after it
        assert torch.equal(bigbird_layout(n, 1, 1, 2, seed=5, causal=True), full[:n, :n])
    # without causal the draws range over all blocks: a prefix's rows change with the length
    assert not all(
        torch.equal(bigbird_layout(n, 1, 1, 2, seed=5), bigbird_layout(16, 1, 1, 2, seed=5)[:n, :n])
        for n in range(4, 16)
    )


def test_a_causal_bigbird_model_computes_the_same_on_a_prefix_as_on_the_whole():
    from mmformer.models.heads import LMHead
    from mmformer.models.model import MultimodalModel
    from mmformer.tokenizers import TextEmbedding

    torch.manual_seed(0)
    backbone = build_backbone(
        32,
        2,
        AttentionConfig(4),
        positions=PositionConfig("rope"),
        long_context=LongContextConfig(bigbird=BigBirdConfig(block=2, window=0, random_blocks=1)),
        causal=True,
    )
    model = MultimodalModel({"text": TextEmbedding(50, 32)}, backbone, {"lm": LMHead(32, 50)}).eval()
    ids = torch.randint(0, 50, (1, 40))
    with torch.no_grad():
        full = model(ids, "text", "lm")
        for n in (9, 17, 26, 33):  # 5, 9, 13 and 17 blocks of the 20
            torch.testing.assert_close(model(ids[:, :n], "text", "lm"), full[:, :n], rtol=1e-5, atol=1e-5)


def test_kernels_agree_on_the_block_sparse_mask():
    torch.manual_seed(0)
    attn = Attention(32, 4).eval()
    x = torch.randn(2, 40, 32)
    layout = bigbird_layout(5, 1, 1, 1, seed=0)
    valid = torch.arange(40)[None].expand(2, 40) < torch.tensor([[40], [33]])
    outs = {}
    for kernel in ("eager", "sdpa", "flex"):
        attn.kernel = kernel
        mask = MaskSpec(valid=valid, sparse_layout=layout, sparse_block=8)
        with torch.no_grad():
            outs[kernel] = attn(x, AttentionInputs(mask=mask))
    torch.testing.assert_close(outs["sdpa"], outs["eager"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["flex"], outs["eager"], rtol=1e-4, atol=1e-4)
    dense = MaskSpec(sparse_layout=layout, sparse_block=8).dense(40)[0, 0]
    assert torch.equal(dense[::8, ::8], layout)  # the token mask is the block layout, blown up


def test_a_bigbird_backbone_trains_and_decodes_like_recomputation():
    from mmformer.models.heads import LMHead
    from mmformer.models.model import MultimodalModel
    from mmformer.nn.attention import KVCache
    from mmformer.tokenizers import TextEmbedding

    torch.manual_seed(0)
    backbone = build_backbone(
        32,
        2,
        AttentionConfig(4),
        positions=PositionConfig("rope"),
        long_context=LongContextConfig(bigbird=BigBirdConfig(block=4, random_blocks=1)),
        causal=True,
    )
    model = MultimodalModel({"text": TextEmbedding(50, 32)}, backbone, {"lm": LMHead(32, 50)}).eval()
    ids = torch.randint(0, 50, (1, 24))
    with torch.no_grad():
        full = model(ids, "text", "lm")
        cache = KVCache()
        model(ids[:, :20], "text", "lm", cache=cache)
        nxt = model(ids[:, 20:21], "text", "lm", cache=cache, positions=torch.tensor([[[20]]]))
    torch.testing.assert_close(nxt[:, -1], full[:, 20], rtol=1e-4, atol=1e-4)
    model.train()
    model(ids, "text", "lm").square().mean().backward()
    encoder = build_backbone(
        32, 1, AttentionConfig(4), long_context=LongContextConfig(bigbird=BigBirdConfig(4))
    )
    out = encoder(Tokens.from_embeddings(torch.randn(1, 10, 32), 0))
    assert out.shape == (1, 10, 32)
