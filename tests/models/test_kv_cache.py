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


def test_the_cache_keeps_its_own_metadata_not_views_of_the_callers():
    """The first ``extend`` stores copies: a caller's ``expand``-ed positions would otherwise sit in the
    cache as a view after the prompt and as a fresh tensor after the first ``cat``, and a compiled
    decoding step (which guards on it) compiled twice."""
    cache = KVCache()
    valid = torch.ones(2, 3, dtype=torch.bool)
    positions = torch.arange(3).view(1, 3, 1).expand(2, 3, 1)  # a view, as from_embeddings gives
    cache.extend(valid, torch.zeros(2, 3, dtype=torch.long), positions)
    assert cache.positions._base is None and torch.equal(cache.positions, positions)
    step = cache.next_positions(torch.ones(2, 1, dtype=torch.bool))
    cache.extend(torch.ones(2, 1, dtype=torch.bool), torch.zeros(2, 1, dtype=torch.long), step)
    assert cache.positions._base is None and cache.positions[:, -1, 0].tolist() == [3, 3]


def _text_lm(max_len=None, **backbone):
    """A causal text model through ``MultimodalModel`` (tokenizer ``text``, head ``lm``)."""
    from mmformer.models import MultimodalModel
    from mmformer.models.heads import LMHead
    from mmformer.tokenizers.text import TextEmbedding

    torch.manual_seed(0)
    text = TextEmbedding(V, D, max_len=max_len)
    if max_len:
        torch.nn.init.normal_(text.pos_embed.weight, std=1.0)  # positions that matter to every logit
    trunk = build_backbone(D, 2, AttentionConfig(4), causal=True, **backbone)
    return MultimodalModel({"text": text}, trunk, {"lm": LMHead(D, V)}).eval()


@pytest.mark.parametrize(
    "variant",
    [dict(positions=PositionConfig("rope")), dict(max_len=16)],
    ids=["rope", "learned_absolute"],
)
def test_a_cached_step_without_positions_continues_from_the_cache(variant):
    """``model(ids, …, cache=c)`` without ``positions=``: the new token is position 11 after 11 cached
    ones (as HF's ``cache_position`` defaults to the past length), not 0."""
    model = _text_lm(**variant)
    ids = torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids, "text", "lm")[:, -1]
        cache = KVCache()
        model(ids[:, :11], "text", "lm", cache=cache)
        step = model(ids[:, 11:], "text", "lm", cache=cache)[:, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


def test_cached_steps_without_positions_continue_each_left_padded_row():
    """Rows of a left-padded prompt batch hold different numbers of real tokens (11 and 6): each row's
    next token continues from its own count, ``cache.valid.sum(1)``."""
    model = _text_lm(max_len=16, positions=PositionConfig("rope"))
    ids = torch.randint(1, V, (2, 13), generator=torch.Generator().manual_seed(3))
    valid = torch.ones(2, 13, dtype=torch.bool)
    valid[1, :5] = False
    with torch.no_grad():
        full = model(ids, "text", "lm", valid=valid)[:, -2:]
        cache = KVCache()
        model(ids[:, :11], "text", "lm", cache=cache, valid=valid[:, :11])
        steps = [model(ids[:, t : t + 1], "text", "lm", cache=cache)[:, -1] for t in (11, 12)]
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.positions[:, -2:, 0].tolist() == [[11, 12], [6, 7]]


def test_a_cached_step_with_documents_and_no_positions_is_refused():
    model = _text_lm(positions=PositionConfig("rope"))
    ids = torch.randint(1, V, (1, 4), generator=torch.Generator().manual_seed(4))
    cache = KVCache()
    with torch.no_grad():
        model(ids[:, :3], "text", "lm", cache=cache)
        with pytest.raises(ValueError, match="pass positions"):
            model(ids[:, 3:], "text", "lm", cache=cache, document=torch.ones(1, 1, dtype=torch.long))


@pytest.mark.parametrize("kind", ["rope", "alibi", "t5"])
def test_backbone_tokens_whose_positions_restart_after_the_cache_are_refused(kind):
    """``Tokens.from_embeddings`` counts from 0: fed after cached tokens to a backbone whose attention reads
    positions, that would silently read the new token as the first one."""
    backbone = build_backbone(D, 1, AttentionConfig(4), causal=True, positions=PositionConfig(kind)).eval()
    x = torch.randn(2, 4, D)
    cache = KVCache()
    with torch.no_grad():
        backbone(Tokens.from_embeddings(x[:, :3], 0), cache=cache)
        with pytest.raises(ValueError, match=r"must continue.*restart.*cache\.next_positions"):
            backbone(Tokens.from_embeddings(x[:, 3:], 0), cache=cache)
        step = Tokens.from_embeddings(x[:, 3:], 0, positions=cache.next_positions(torch.ones(2, 1).bool()))
        torch.testing.assert_close(backbone(step, cache=cache), backbone(Tokens.from_embeddings(x, 0))[:, 3:])
