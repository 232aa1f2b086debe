"""BigBird block-sparse attention: the layout has its band, global and random blocks, drawn for each head
and layer; eager (dense mask), sdpa (the key blocks gathered, or a dense mask where gathering saves
nothing) and flex (block mask) agree on it, values and gradients; a backbone with it trains and decodes."""

from __future__ import annotations

import pytest
import torch

from mmformer.models import AttentionConfig, BigBirdConfig, LongContextConfig, PositionConfig, build_backbone
from mmformer.nn.attention import Attention, AttentionInputs
from mmformer.nn.block_sparse import block_sparse_attention, gathers
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


def test_each_head_draws_its_own_random_blocks_around_the_same_band_and_globals():
    heads = bigbird_layout(16, window=1, global_blocks=1, random_blocks=2, seed=4, n_heads=4)
    assert heads.shape == (4, 16, 16)
    for head in heads:
        assert head[:1].all() and head[:, :1].all()
        for i in range(1, 16):
            band = {j for j in range(max(0, i - 1), min(16, i + 2))} | {0}
            assert set(head[i].nonzero().flatten().tolist()) >= band
            assert int(head[i].sum()) == len(band) + 2  # two random blocks of its own
    assert len({tuple(h.flatten().tolist()) for h in heads}) == 4  # the heads' draws differ
    assert torch.equal(heads, bigbird_layout(16, 1, 1, 2, seed=4, n_heads=4))  # seeded
    causal = bigbird_layout(16, 1, 1, 2, seed=4, causal=True, n_heads=4)
    for n in (5, 11):  # every head keeps the prefix property
        assert torch.equal(bigbird_layout(n, 1, 1, 2, seed=4, causal=True, n_heads=4), causal[:, :n, :n])


def _masks(N: int, block: int, heads: int | None) -> dict[str, MaskSpec]:
    """Every rule a block layout combines with, over ``N`` tokens of 2 rows (the second padded)."""
    nb = -(-N // block)
    valid = torch.arange(N)[None].expand(2, N) < torch.tensor([[N], [N - 13]])
    document = (torch.arange(N)[None].expand(2, N) >= torch.tensor([[N], [N // 3]])).long()
    span = torch.zeros(2, N, dtype=torch.long)
    span[:, 3:11] = 1
    layout = bigbird_layout(nb, 1, 1, 1, seed=2, n_heads=heads)
    causal_layout = bigbird_layout(nb, 1, 1, 1, seed=2, causal=True, n_heads=heads)
    kw = dict(sparse_layout=layout, sparse_block=block)
    return {
        "layout": MaskSpec(**kw),
        "padding": MaskSpec(valid=valid, **kw),
        "causal + spans": MaskSpec(
            causal=True, valid=valid, span=span, sparse_layout=causal_layout, sparse_block=block
        ),
        "documents + window": MaskSpec(valid=valid, document=document, window=9, **kw),
    }


@pytest.mark.parametrize("heads", [None, 4])
@pytest.mark.parametrize("N", [96, 91])  # whole blocks, and a partial last block
def test_gathered_blocks_equal_attention_under_the_dense_mask(heads, N):
    g = torch.Generator().manual_seed(0)
    for name, mask in _masks(N, 8, heads).items():
        assert gathers(mask, N, N), name
        q, k, v = (torch.randn(2, 4, N, 16, generator=g, requires_grad=True) for _ in range(3))
        dense = mask.dense(N)
        want = torch.softmax((q @ k.transpose(-1, -2) / 4).masked_fill(~dense, float("-inf")), -1)
        want = (want.nan_to_num(0.0) @ v) * dense.any(-1, keepdim=True)  # fully masked rows: zeros
        got = block_sparse_attention(q, k, v, mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
        w = torch.randn(got.shape, generator=g)
        for a, b in zip(
            torch.autograd.grad((got * w).sum(), (q, k, v)), torch.autograd.grad((want * w).sum(), (q, k, v))
        ):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_sdpa_gathers_the_blocks_without_a_dense_mask_and_agrees_with_eager_and_flex():
    torch.manual_seed(0)
    attn = Attention(32, 4, n_kv_heads=2).eval()  # grouped keys and values too
    x = torch.randn(2, 75, 32)
    mask = _masks(75, 8, 4)["padding"]
    outs = {}
    for kernel in ("eager", "sdpa", "flex"):
        attn.kernel = kernel
        inputs = AttentionInputs(mask=mask).prepared({kernel}, 75, 75, 2, x.device)
        if kernel == "sdpa":  # the memory BigBird saves: no (B, H, N, N) mask is built
            assert inputs.kernel_mask.gather is not None and inputs.kernel_mask.dense is None
        with torch.no_grad():
            outs[kernel] = attn(x, inputs)
    torch.testing.assert_close(outs["sdpa"], outs["eager"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["flex"], outs["eager"], rtol=1e-4, atol=1e-4)


def test_short_sequences_and_cached_queries_keep_the_dense_mask():
    layout = bigbird_layout(4, 1, 1, 1)  # every row reads 3 or 4 of 4 blocks: gathering saves nothing
    assert not gathers(MaskSpec(sparse_layout=layout, sparse_block=8), 32, 32)
    long = MaskSpec(sparse_layout=bigbird_layout(16, 1, 1, 1), sparse_block=8)
    assert gathers(long, 128, 128)
    assert not gathers(long, 1, 128)  # one query decoded against a KV cache
    assert not gathers(long, 64, 64)  # a layout for more tokens: the dense mask reads its corner
    with pytest.raises(ValueError, match="Nq == Nk"):
        block_sparse_attention(
            *(torch.randn(1, 1, 128, 8) for _ in range(2)), torch.randn(1, 1, 120, 8), long
        )
    with pytest.raises(ValueError, match="does not cover 100 tokens"):
        block_sparse_attention(*(torch.randn(1, 1, 100, 8) for _ in range(3)), long)


def test_each_layer_reads_its_own_layout_and_the_kernels_agree_through_a_backbone():
    torch.manual_seed(0)
    bigbird = BigBirdConfig(block=4, window=1, global_blocks=1, random_blocks=1)
    backbone = build_backbone(32, 3, AttentionConfig(4), long_context=LongContextConfig(bigbird=bigbird))
    tokens = Tokens.from_embeddings(
        torch.randn(2, 64, 32), 0, valid=torch.arange(64)[None] < torch.tensor([[64], [50]])
    )
    layouts = backbone.attention_inputs(tokens, None, None, None).mask.sparse_layout
    assert layouts.shape == (3, 4, 16, 16)
    assert not torch.equal(layouts[0], layouts[1]) and not torch.equal(layouts[1], layouts[2])
    _sdpa_agrees_with_eager(backbone, tokens)
    with pytest.raises(ValueError, match="for_layer"):  # the rule of no layer in particular
        MaskSpec(sparse_layout=layouts, sparse_block=4).dense(64)


def test_bigbird_flops_are_the_blocks_its_layouts_read():
    from mmformer.models.flops import analytic_flops, count_flops
    from mmformer.nn.block_sparse import layout_pairs

    # window 0: every row but the global one reads itself, the global block and one random block
    layout = bigbird_layout(8, window=0, global_blocks=1, random_blocks=1, seed=1, n_heads=2)
    assert layout_pairs(layout, 4, 32, 32) == 4 * 32 + 7 * 3 * 4 * 4  # the global row reads all keys
    for n_q, n_k in ((30, 30), (1, 30), (5, 29)):  # a partial last block; queries behind a KV cache
        dense = MaskSpec(sparse_layout=layout, sparse_block=4, q_offset=n_k - n_q).dense(n_q, n_k)
        assert layout_pairs(layout, 4, n_q, n_k) == dense.sum().item() / 2  # token pairs per head
    torch.manual_seed(0)
    bigbird = BigBirdConfig(block=4, window=1, global_blocks=1, random_blocks=1)
    sparse = build_backbone(32, 2, AttentionConfig(2), long_context=LongContextConfig(bigbird=bigbird))
    dense = build_backbone(32, 2, AttentionConfig(2))
    from mmformer.models.heads import ClassifierHead
    from mmformer.models.model import MultimodalModel
    from mmformer.tokenizers import TextEmbedding

    ids = torch.randint(0, 50, (3, 64))
    flops = {}
    for name, backbone in (("sparse", sparse), ("dense", dense)):
        model = MultimodalModel(
            {"text": TextEmbedding(50, 32)}, backbone, {"cls": ClassifierHead(32, 5, pool="mean")}
        )  # every row
        flops[name] = analytic_flops(model, ids, "text", "cls")
    layouts = bigbird.layer_layouts(64, False, 2, 2)
    saved = sum(4 * 3 * 32 * (64 * 64 - layout_pairs(layouts[i], 4, 64, 64)) for i in range(2))  # B H Dh
    assert flops["dense"] - flops["sparse"] == saved > 0
    # eager computes every pair under the mask, as count_flops (which runs the softmax kernels as eager) sees
    for block in sparse.blocks:
        block.attn.kernel = "eager"
    model = MultimodalModel(
        {"text": TextEmbedding(50, 32)}, sparse, {"cls": ClassifierHead(32, 5, pool="mean")}
    )
    assert (
        analytic_flops(model, ids, "text", "cls")
        == count_flops(model, ids, "text", "cls")["forward"]
        == flops["dense"]
    )


def test_reversible_layers_read_each_layers_layout_in_training_as_in_inference():
    from mmformer.models import BlockConfig
    from mmformer.nn.reversible import stored_activations

    torch.manual_seed(0)
    bigbird = BigBirdConfig(block=4, window=1, global_blocks=1, random_blocks=1)
    backbone = build_backbone(
        32,
        3,
        AttentionConfig(4),
        long_context=LongContextConfig(bigbird=bigbird),
        block=BlockConfig(reversible=True),
    )
    x = torch.randn(2, 64, 32)
    with torch.no_grad():
        want = backbone(Tokens.from_embeddings(x, 0))  # the plain loop, layer by layer
    leaf = x.clone().requires_grad_()
    got = backbone(Tokens.from_embeddings(leaf, 0))  # the reversible function, recomputing in backward
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(got.square().sum(), leaf)
    leaf = x.clone().requires_grad_()
    with stored_activations():
        (ref,) = torch.autograd.grad(backbone(Tokens.from_embeddings(leaf, 0)).square().sum(), leaf)
    torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-5)


def test_a_layout_that_is_not_square_or_not_the_sequences_is_never_gathered():
    layout = bigbird_layout(16, 1, 1, 1)
    assert not gathers(MaskSpec(sparse_layout=layout[:10], sparse_block=4), 64, 64)
    with pytest.raises(ValueError, match="does not cover 64 tokens"):
        block_sparse_attention(
            *(torch.randn(1, 1, 64, 8) for _ in range(3)), MaskSpec(sparse_layout=layout[:10], sparse_block=4)
        )


def test_causal_layouts_drawn_once_for_longer_sequences_equal_their_own_draws():
    bigbird = BigBirdConfig(block=4, window=1, global_blocks=1, random_blocks=2)
    for n_tokens in (4, 21, 40, 64, 65):  # 1, 6, 10, 16, 17 blocks: drawn for 1, 8, 16, 16, 32
        blocks = -(-n_tokens // 4)
        want = torch.stack(
            [bigbird_layout(blocks, 1, 1, 2, seed=i, causal=True, n_heads=3) for i in range(2)]
        )
        assert torch.equal(bigbird.layer_layouts(n_tokens, True, 3, 2), want)
    want = torch.stack([bigbird_layout(10, 1, 1, 2, seed=i, n_heads=3) for i in range(2)])
    assert torch.equal(bigbird.layer_layouts(40, False, 3, 2), want)  # bidirectional: drawn for its length


def test_a_layouts_gather_plan_is_made_once_and_compiled_blocks_gather_without_a_graph_break(monkeypatch):
    """The plan (which blocks each query block gathers) is read from the layout once, outside the layers:
    a later forward reads no layout on the host, and blocks compiled with ``fullgraph=True`` (where a
    data-dependent read would raise) compute the gathered attention, equal to the eager forward."""
    from mmformer.models.parallelize import compile_blocks
    from mmformer.nn import block_sparse

    torch.manual_seed(0)
    bigbird = BigBirdConfig(block=4, window=1, global_blocks=1, random_blocks=1)
    backbone = build_backbone(
        32, 2, AttentionConfig(4, kernel="sdpa"), long_context=LongContextConfig(bigbird=bigbird)
    )
    valid = torch.arange(64)[None] < torch.tensor([[64], [50]])
    x = torch.randn(2, 64, 32, requires_grad=True)
    planned = []
    plan = block_sparse._plan
    monkeypatch.setattr(
        block_sparse, "_plan", lambda layout, *args: planned.append(layout.shape) or plan(layout, *args)
    )
    monkeypatch.setattr(block_sparse, "_PLANS", type(block_sparse._PLANS)())
    want = backbone(Tokens.from_embeddings(x, 0, valid=valid))
    assert planned == [(4, 16, 16)] * 2  # one per layer: each layer's own layout
    backbone(Tokens.from_embeddings(x, 0, valid=valid))
    assert len(planned) == 2  # memoised: the second forward reads no layout
    for block in backbone.blocks:
        block.attn.kernel = "eager"
    eager = backbone(Tokens.from_embeddings(x, 0, valid=valid))
    for block in backbone.blocks:
        block.attn.kernel = "sdpa"
    compile_blocks(backbone, fullgraph=True, backend="eager")  # dynamo's graph capture, no codegen
    got = backbone(Tokens.from_embeddings(x, 0, valid=valid))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    grad = torch.autograd.grad(got.square().sum(), x)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(eager.square().sum(), x)[0], rtol=1e-4, atol=1e-5)


def test_block_sparse_attention_given_its_plan_compiles_whole_and_without_it_plans_itself():
    from mmformer.nn import block_sparse

    torch.manual_seed(0)
    layout = bigbird_layout(11, 1, 1, 1, seed=0, n_heads=3)
    valid = torch.arange(88)[None] < torch.tensor([[88], [70]])
    mask = MaskSpec(valid=valid, sparse_layout=layout, sparse_block=8)
    q, k, v = (torch.randn(2, 3, 88, 8) for _ in range(3))
    plan = block_sparse.gather_plan(mask, 88, 88)
    assert plan is block_sparse.gather_plan(mask, 88, 88)  # the same layout tensor: the same plan
    assert (plan.n_full, plan.n_rows) == (1, 10) and plan.cols.shape == (3, 10, plan.width)
    want = block_sparse_attention(q, k, v, mask)
    compiled = torch.compile(block_sparse_attention, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, mask, 0.0, plan), want, rtol=0, atol=0)
    dense = mask.dense(88)  # (2, 3, 88, 88)
    ref = torch.softmax((q @ k.transpose(-1, -2) / 8**0.5).masked_fill(~dense, float("-inf")), -1) @ v
    torch.testing.assert_close(want, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 7, 16, 33])
def test_a_sliding_window_is_gathered_from_its_band_of_blocks_and_equals_the_dense_mask(window, causal):
    """A window without a layout is computed over the band of blocks covering it (``window_band``): equal
    to attention under the dense mask, values and gradients, with padding, documents and a partial last
    block; the band reads every key the window allows and few more."""
    from mmformer.nn.block_sparse import window_band

    N = 203
    layout, block = window_band(window, N, causal)
    reads = MaskSpec(sparse_layout=layout, sparse_block=block, causal=causal).dense(N)[0, 0]
    assert not (MaskSpec(window=window, causal=causal).dense(N)[0, 0] & ~reads).any()  # covers the window
    assert block == max(8, -(-window // 2)) and reads.sum(-1).max() <= (3 if causal else 5) * block
    g = torch.Generator().manual_seed(window)
    valid = torch.arange(N)[None] < torch.tensor([[N], [150]])
    document = (torch.arange(N)[None] >= torch.tensor([[0], [90]])).long()  # row 1: two documents
    for mask in (
        MaskSpec(window=window, causal=causal),
        MaskSpec(window=window, causal=causal, valid=valid, document=document),
    ):
        assert gathers(mask, N, N)
        q, k, v = (torch.randn(2, 2, N, 8, generator=g, requires_grad=True) for _ in range(3))
        dense = mask.dense(N)
        want = torch.softmax((q @ k.transpose(-1, -2) / 8**0.5).masked_fill(~dense, float("-inf")), -1)
        want = (want.nan_to_num(0.0) @ v) * dense.any(-1, keepdim=True)
        got = block_sparse_attention(q, k, v, mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        w = torch.randn(got.shape, generator=g)
        for a, b in zip(
            torch.autograd.grad((got * w).sum(), (q, k, v)), torch.autograd.grad((want * w).sum(), (q, k, v))
        ):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_window_backbone_gathers_on_sdpa_and_agrees_with_eager():
    torch.manual_seed(0)
    backbone = build_backbone(
        32, 2, AttentionConfig(4, kernel="sdpa"), long_context=LongContextConfig(window=24), causal=True
    )
    tokens = Tokens.from_embeddings(
        torch.randn(2, 160, 32), 0, valid=torch.arange(160)[None] < torch.tensor([[160], [131]])
    )
    inputs = backbone.attention_inputs(tokens, None, None, None).prepared(
        {"sdpa"}, 160, 160, 2, tokens.x.device
    )
    assert inputs.kernel_mask.gather is not None and inputs.kernel_mask.dense is None  # no N × N mask
    short = backbone.attention_inputs(
        Tokens.from_embeddings(torch.randn(1, 40, 32), 0), None, None, None
    ).prepared({"sdpa"}, 40, 40, 1, tokens.x.device)
    assert (
        short.kernel_mask.gather is None
    )  # 40 tokens: the band reads most blocks, a dense mask is no dearer
    _sdpa_agrees_with_eager(backbone, tokens)


def test_a_window_gathered_by_sdpa_is_counted_as_its_band_and_as_every_pair_where_it_is_not():
    from mmformer.models.flops import analytic_flops, count_flops
    from mmformer.models.heads import LMHead
    from mmformer.models.model import MultimodalModel
    from mmformer.nn.block_sparse import layout_pairs, window_band
    from mmformer.tokenizers import TextEmbedding

    torch.manual_seed(0)
    flops = {}
    for name, window in (("window", 8), ("full", None)):
        backbone = build_backbone(
            32, 2, AttentionConfig(2), long_context=LongContextConfig(window=window), causal=True
        )
        model = MultimodalModel({"text": TextEmbedding(50, 32)}, backbone, {"lm": LMHead(32, 50)})
        flops[name] = {n: analytic_flops(model, torch.randint(0, 50, (3, n)), "text", "lm") for n in (24, 64)}
    band, block = window_band(8, 64, True)  # blocks of 8: each reads itself and the one before
    assert block == 8 and layout_pairs(band, 8, 64, 64) == 8 * 8 + 7 * 2 * 64
    saved = 2 * 4 * 3 * 2 * 16 * (64 * 64 - layout_pairs(band, 8, 64, 64))  # layers, 4, B, H, Dh
    assert flops["full"][64] - flops["window"][64] == saved > 0
    assert flops["full"][24] == flops["window"][24]  # 3 blocks, 2 read: not gathered, every pair computed
    for block in backbone.blocks:  # eager computes every pair, as count_flops sees
        block.attn.kernel = "eager"
    ids = torch.randint(0, 50, (3, 64))
    assert analytic_flops(model, ids, "text", "lm") == count_flops(model, ids, "text", "lm")["forward"]


def test_what_no_band_covers_keeps_the_dense_mask_and_what_changes_a_layout_replans():
    """A causal window with prefix-LM spans (a span's queries read its later keys, however far) and a
    score bias (ALiBi) are not gathered — computed and counted in full; a layout changed in place gets a
    new plan; a window's plan is arithmetic, so a layer compiled whole (``fullgraph``) plans it itself."""
    from mmformer.models.flops import analytic_flops
    from mmformer.models.heads import LMHead
    from mmformer.models.model import MultimodalModel
    from mmformer.nn import block_sparse
    from mmformer.tokenizers import TextEmbedding

    torch.manual_seed(0)
    span = (torch.arange(64) < 32).long()[None].expand(2, 64)
    mask = MaskSpec(causal=True, window=8, span=span)
    assert not gathers(mask, 64, 64) and gathers(MaskSpec(causal=True, window=8), 64, 64)
    with pytest.raises(ValueError, match="no band of blocks covers this mask"):
        block_sparse_attention(*(torch.randn(2, 2, 64, 16) for _ in range(3)), mask)
    attn = Attention(32, 2, kernel="sdpa")
    x = torch.randn(2, 64, 32)
    want = attn(x, mask)
    attn.kernel = "eager"
    torch.testing.assert_close(want, attn(x, mask), rtol=1e-5, atol=1e-5)

    flops = {}
    for window in (8, None):
        backbone = build_backbone(
            32,
            2,
            AttentionConfig(2),
            positions=PositionConfig("alibi"),
            long_context=LongContextConfig(window=window),
            causal=True,
        )
        model = MultimodalModel({"text": TextEmbedding(50, 32)}, backbone, {"lm": LMHead(32, 50)})
        flops[window] = analytic_flops(model, torch.randint(0, 50, (1, 64)), "text", "lm")
    assert flops[8] == flops[None]  # with a score bias sdpa computes every pair

    layout = bigbird_layout(8, 0, 0, 1, seed=0)
    before = block_sparse.gather_plan(MaskSpec(sparse_layout=layout, sparse_block=4), 32, 32)
    layout[5] = True  # row 5 now reads every block
    after = block_sparse.gather_plan(MaskSpec(sparse_layout=layout, sparse_block=4), 32, 32)
    assert after is not before and (before.n_full, after.n_full) == (0, 1)  # row 5: to all keys

    attn = Attention(32, 2, kernel="sdpa")
    window = AttentionInputs(mask=MaskSpec(causal=True, window=16))
    compiled = torch.compile(attn, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, window), attn(x, window), rtol=0, atol=0)


def _sdpa_agrees_with_eager(backbone, tokens: Tokens) -> None:
    """The backbone's output and input gradient with every layer on sdpa equal those on eager."""
    x = tokens.x.clone().requires_grad_()
    outs, grads = {}, {}
    for kernel in ("eager", "sdpa"):
        for block in backbone.blocks:
            block.attn.kernel = kernel
        out = backbone(Tokens.from_embeddings(x, 0, valid=tokens.valid))
        outs[kernel], grads[kernel] = out, torch.autograd.grad(out.square().sum(), x)[0]
    torch.testing.assert_close(outs["sdpa"], outs["eager"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads["sdpa"], grads["eager"], rtol=1e-4, atol=1e-5)
