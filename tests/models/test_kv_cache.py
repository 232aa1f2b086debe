"""KV-cache decoding equals full recomputation: one token at a time and after a two-chunk prefill,
for a left-padded batch of prompts of different lengths (Llama-style: RoPE, GQA, RMSNorm, SwiGLU)."""

import pytest
import torch
from torch import nn

from mmformer.models import AttentionConfig, LongContextConfig, MlpConfig, PositionConfig, build_backbone
from mmformer.nn import KVCache, Tokens

V, D = 50, 32


class TinyLM(nn.Module):
    def __init__(self, attention: AttentionConfig | None = None, **backbone):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.backbone = build_backbone(D, 3, attention or AttentionConfig(4), causal=True, **backbone)
        self.head = nn.Linear(D, V)

    def forward(self, ids, valid, positions=None, cache=None):
        x = self.embed(ids)
        tokens = Tokens.from_embeddings(x, 0, valid=valid, positions=positions)
        return self.head(self.backbone(tokens, cache=cache))


def _prompts():
    lengths = [5, 2, 7]
    ids = torch.zeros(3, 7, dtype=torch.long)
    valid = torch.zeros(3, 7, dtype=torch.bool)
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate(lengths):  # left padding
        ids[i, 7 - n :] = torch.randint(1, V, (n,), generator=g)
        valid[i, 7 - n :] = True
    return ids, valid


def _greedy_full(model, ids, valid, steps):
    logits_seen = []
    for _ in range(steps):
        logits = model(ids, valid)[:, -1]
        logits_seen.append(logits)
        nxt = logits.argmax(-1, keepdim=True)
        ids, valid = torch.cat([ids, nxt], 1), torch.cat([valid, torch.ones_like(nxt, dtype=torch.bool)], 1)
    return ids, torch.stack(logits_seen, 1)


def _greedy_cached(model, ids, valid, steps, chunks):
    cache = KVCache()
    positions = Tokens.from_embeddings(torch.zeros(*ids.shape, 1), 0, valid=valid).positions
    bounds = torch.linspace(0, ids.shape[1], chunks + 1).long().tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):  # chunked prefill
        logits = model(ids[:, a:b], valid[:, a:b], positions[:, a:b], cache)[:, -1]
    logits_seen = []
    for _ in range(steps):
        logits_seen.append(logits)
        nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
        pos = cache.valid.sum(1, keepdim=True).unsqueeze(-1)  # positions continue from each row's length
        logits = model(nxt, torch.ones_like(nxt, dtype=torch.bool), pos, cache)[:, -1]
    return ids, torch.stack(logits_seen, 1)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize(
    "variant",
    [
        dict(
            attention=AttentionConfig(4, n_kv_heads=2, qkv_bias=False),
            norm="rmsnorm",
            mlp=MlpConfig(act="swiglu", bias=False),
            positions=PositionConfig("rope"),
        ),
        dict(positions=PositionConfig("alibi")),
        dict(long_context=LongContextConfig(window=4)),
    ],
    ids=["llama", "alibi", "window"],
)
def test_cached_decoding_equals_full_recomputation(variant, chunks):
    model = TinyLM(**variant).eval()
    ids, valid = _prompts()
    with torch.no_grad():
        full_ids, full_logits = _greedy_full(model, ids, valid, steps=6)
        cached_ids, cached_logits = _greedy_cached(model, ids, valid, steps=6, chunks=chunks)
    assert torch.equal(cached_ids, full_ids)
    torch.testing.assert_close(cached_logits, full_logits, atol=1e-5, rtol=1e-5)


def test_left_padding_changes_nothing_for_real_tokens():
    model = TinyLM(norm="rmsnorm", mlp=MlpConfig(act="swiglu"), positions=PositionConfig("rope")).eval()
    ids, valid = _prompts()
    with torch.no_grad():
        batched = model(ids, valid)
        for i in range(3):
            n = int(valid[i].sum())
            alone = model(ids[i : i + 1, 7 - n :], valid[i : i + 1, 7 - n :])
            torch.testing.assert_close(batched[i : i + 1, 7 - n :], alone, atol=1e-5, rtol=1e-5)


def test_a_span_split_across_prefill_chunks_is_refused():
    from mmformer.nn import MODALITY_IDS

    image_spans = (MODALITY_IDS["image"],)
    backbone = build_backbone(
        D, 1, AttentionConfig(4), causal=True, bidirectional_modalities=image_spans
    ).eval()
    x = torch.randn(1, 6, D)
    image = Tokens.from_embeddings(x, MODALITY_IDS["image"])
    cache = KVCache()
    with torch.no_grad():
        backbone(Tokens.from_embeddings(x[:, :3], MODALITY_IDS["image"]), cache=cache)
        second = Tokens.from_embeddings(x[:, 3:], MODALITY_IDS["image"], positions=image.positions[:, 3:])
        with pytest.raises(ValueError, match="must be prefilled in one chunk"):
            backbone(second, cache=cache)


def test_prefix_in_one_chunk_then_cached_decoding_equals_full_forward():
    from mmformer.nn import MODALITY_IDS, cat_tokens

    backbone = build_backbone(
        D,
        2,
        AttentionConfig(4),
        positions=PositionConfig("rope"),
        causal=True,
        bidirectional_modalities=(MODALITY_IDS["image"],),
    ).eval()
    img, txt = torch.randn(1, 4, D), torch.randn(1, 3, D)
    image = Tokens.from_embeddings(img, MODALITY_IDS["image"])
    text = Tokens.from_embeddings(txt, MODALITY_IDS["text"], positions=torch.arange(4, 7).view(1, 3, 1))
    with torch.no_grad():
        full = backbone(cat_tokens([image, text]))
        cache = KVCache()
        parts = [backbone(image, cache=cache)]
        for i in range(3):
            step = Tokens.from_embeddings(
                txt[:, i : i + 1], MODALITY_IDS["text"], positions=torch.tensor([[[4 + i]]])
            )
            parts.append(backbone(step, cache=cache))
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_the_cache_appends_in_place_and_reorders_rows():
    """Keys/values equal the concatenation of what was appended; a step within the buffer's room writes
    in place (no copy of the past); growing keeps the past; ``reorder`` picks rows, room kept."""
    torch.manual_seed(0)
    cache, parts = KVCache(), []
    for step, n in enumerate([5, 1, 1, 1, 20, 1]):
        k = torch.randn(3, 2, n, 4)
        parts.append(k)
        before = cache._buffers.get(0, (None,))[0]
        got_k, got_v = cache.update(0, k, -k)
        torch.testing.assert_close(got_k, torch.cat(parts, dim=2), rtol=0, atol=0)
        torch.testing.assert_close(got_v, -torch.cat(parts, dim=2), rtol=0, atol=0)
        if step in (1, 2, 3):  # 16 slots after the 5-token prefill: one-token steps write in place
            assert cache._buffers[0][0].data_ptr() == before.data_ptr()
    index = torch.tensor([2, 2, 0])
    cache.reorder(index)
    torch.testing.assert_close(cache.keys[0], torch.cat(parts, dim=2)[index], rtol=0, atol=0)
    assert cache._buffers[0][0].shape[2] > cache.keys[0].shape[2]
    reordered = torch.cat(parts, dim=2)[index]
    k = torch.randn(3, 2, 1, 4)
    torch.testing.assert_close(cache.update(0, k, k)[0], torch.cat([reordered, k], 2), rtol=0, atol=0)


def test_a_cache_told_its_capacity_allocates_once():
    cache = KVCache(capacity=9)
    first = cache.update(0, torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))[0]
    buffer = cache._buffers[0][0]
    assert buffer.shape[2] == 9
    for _ in range(4):
        cache.update(0, torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert cache._buffers[0][0] is buffer and torch.equal(cache.keys[0][:, :, :5], first)
    cache.update(0, torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))  # past the capacity: grows
    assert cache._buffers[0][0].shape[2] > 9 and cache.keys[0].shape[2] == 10
