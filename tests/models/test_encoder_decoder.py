"""Encoder–decoder: decoding with the KV cache (self-attention cache growing, cross-attention keys/values
computed once) equals recomputing the whole decoder every step; source padding changes nothing; batched
decoding equals one source at a time (greedy and beam search)."""

import pytest
import torch

from mmformer.models import AttentionConfig, BlockConfig, build_backbone
from mmformer.models.encoder_decoder import EncoderDecoder
from mmformer.models.heads import LMHead
from mmformer.models.model import MultimodalModel
from mmformer.nn import KVCache
from mmformer.tokenizers.text import TextEmbedding

V_SRC, V, D_ENC, D = 40, 30, 24, 32
PARTS = EncoderDecoder("source", "text", "lm")


def _model(seed: int = 0, **decoder) -> MultimodalModel:
    torch.manual_seed(seed)
    encoder = build_backbone(D_ENC, 2, AttentionConfig(4))
    cross = BlockConfig("cross", d_context=D_ENC)
    dec = build_backbone(D, 3, AttentionConfig(4), block=cross, causal=True, **decoder)
    text = TextEmbedding(V, D, max_len=64)
    lm = LMHead(D, V)
    lm.tie_to(text.embed)
    model = MultimodalModel(
        {"source": TextEmbedding(V_SRC, D_ENC, max_len=64), "text": text},
        dec,
        {"lm": lm},
        {"source": encoder},
    )
    return model.eval()


def _sources():
    """Three right-padded sources of 6, 3 and 9 tokens, ``(3, 9)`` ids and validity."""
    g = torch.Generator().manual_seed(1)
    ids, valid = torch.zeros(3, 9, dtype=torch.long), torch.zeros(3, 9, dtype=torch.bool)
    for i, n in enumerate((6, 3, 9)):
        ids[i, :n] = torch.randint(1, V_SRC, (n,), generator=g)
        valid[i, :n] = True
    return ids, valid


def _greedy_recompute(model, src, src_valid, prompt, steps):
    """Greedy decoding that reruns encoder and decoder on the whole text every step (no cache)."""
    ids = torch.tensor(prompt).expand(src.shape[0], -1)
    for _ in range(steps):
        logits = PARTS.logits(model, src, ids, torch.ones_like(ids, dtype=torch.bool), src_valid)[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[:, len(prompt) :].tolist()


@torch.no_grad()
def test_cached_steps_equal_teacher_forced_logits():
    model = _model()
    src, src_valid = _sources()
    target = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(2))
    full = PARTS.logits(model, src, target, torch.ones_like(target, dtype=torch.bool), src_valid)
    context = PARTS.encode(model, src, src_valid)
    cache, steps = KVCache(), []
    prefill = PARTS._text(model, target[:, :2], None)  # a two-token prompt, then one token per step
    steps.append(model.heads["lm"](model.backbone(prefill, context=context, cache=cache), prefill))
    for t in range(2, 7):
        text = PARTS._text(model, target[:, t : t + 1], None, start=t)
        steps.append(model.heads["lm"](model.backbone(text, context=context, cache=cache), text))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert set(cache.cross) == {0, 1, 2} and cache.length == 7


@torch.no_grad()
def test_the_decoder_reads_the_source():
    model = _model()
    src, src_valid = _sources()
    target = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(2))
    ones = torch.ones_like(target, dtype=torch.bool)
    other = src.roll(1, dims=0), src_valid.roll(1, dims=0)  # each row gets another row's source
    a, b = (
        PARTS.logits(model, src, target, ones, src_valid),
        PARTS.logits(model, *other[:1], target, ones, other[1]),
    )
    assert (a - b).abs().amax(dim=(1, 2)).min() > 1e-3


@pytest.mark.parametrize("beam_size", [1, 3])
@torch.no_grad()
def test_cross_attention_keys_and_values_are_projected_once(beam_size):
    model = _model()
    src, src_valid = _sources()
    calls = []
    for block in model.backbone.blocks:
        block.cross_attn.kv.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    out = PARTS.generate(model, src, [1], None, max_new_tokens=6, beam_size=beam_size)
    assert all(len(o) == 6 for o in out)
    assert len(calls) == 3  # one projection of the context per layer, not one per step
    assert all(shape == (3, 9, D_ENC) for shape in calls)


@torch.no_grad()
def test_greedy_with_cache_equals_recompute():
    model = _model()
    src, src_valid = _sources()
    want = _greedy_recompute(model, src, src_valid, [1, 2], steps=8)
    got = PARTS.generate(model, src, [1, 2], None, max_new_tokens=8, source_valid=src_valid)
    assert got == want


@torch.no_grad()
def test_source_padding_changes_nothing():
    model = _model()
    src, src_valid = _sources()
    padded = torch.cat([src, torch.full((3, 5), 7)], dim=1)  # five more padding tokens holding real ids
    padded_valid = torch.cat([src_valid, torch.zeros(3, 5, dtype=torch.bool)], dim=1)
    target = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(3))
    ones = torch.ones_like(target, dtype=torch.bool)
    torch.testing.assert_close(
        PARTS.logits(model, padded, target, ones, padded_valid),
        PARTS.logits(model, src, target, ones, src_valid),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("beam_size", [1, 3])
@torch.no_grad()
def test_batched_decoding_equals_one_source_at_a_time(beam_size):
    model = _model()
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():  # sharper distributions than the 0.02 init, so decoding choices differ
        if p.dim() == 2:
            p.data.normal_(0, 0.5, generator=g)
    src, src_valid = _sources()
    free = PARTS.generate(model, src, 1, None, 7, beam_size, source_valid=src_valid)
    first = free[0][0]  # chosen without suppression: the first token of row 0, and the commonest other one
    common = max((t for t in range(V) if t != first), key=lambda t: sum(row.count(t) for row in free))
    assert any(common in row for row in free)
    kw = {"max_new_tokens": 7, "beam_size": beam_size, "suppress": [common], "suppress_begin": [first]}
    batched = PARTS.generate(model, src, 1, 4, source_valid=src_valid, **kw)
    for i in range(3):
        n = int(src_valid[i].sum())
        one = PARTS.generate(model, src[i : i + 1, :n], 1, 4, **kw)
        assert one == batched[i : i + 1]
    assert all(common not in row for row in batched)  # suppressed everywhere
    assert all(not row or row[0] != first for row in batched)  # suppressed as the first token


def test_generate_refuses_a_prompt_filling_the_positions_and_a_reused_cache():
    model = _model()
    src, src_valid = _sources()
    with pytest.raises(ValueError, match="fills the decoder's 64 positions"):
        PARTS.generate(model, src, list(range(64)), None, 3)
    cache, text = KVCache(), PARTS._text(model, torch.ones(3, 1, dtype=torch.long), None)
    with torch.no_grad():
        model.backbone(text, context=PARTS.encode(model, src, src_valid), cache=cache)
        with pytest.raises(ValueError, match="another context"):
            model.backbone(text, context=PARTS.encode(model, src[:, :4], src_valid[:, :4]), cache=cache)


def test_generate_needs_an_encoder_tower_and_a_cross_attention_decoder():
    model = _model()
    src, _ = _sources()
    with pytest.raises(ValueError, match="model.towers has no 'text'"):
        EncoderDecoder("text", "text", "lm").generate(model, src, 1, None, 3)
    model.backbone = build_backbone(D, 1, AttentionConfig(4), causal=True)
    with pytest.raises(ValueError, match="cross-attention"):
        PARTS.generate(model, src, 1, None, 3)
