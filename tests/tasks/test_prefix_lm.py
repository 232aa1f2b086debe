"""Prefix-LM captioning and speech recognition: the mask (prefix bidirectional, text causal), loss on the
text only, cached decoding equal to recomputation, beam search against exhaustive search, batched equal
to one at a time with padded audio prefixes, the metrics on hand-checked strings, and recipe errors."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from mmformer.models import AttentionConfig, MultimodalModel, PositionConfig, build_backbone
from mmformer.models.heads import LMHead
from mmformer.models.prefix_lm import PrefixLM
from mmformer.tasks.prefix_lm import PrefixLMTask, caption_targets, normalize_text
from mmformer.tokenizers import ViTPatchTokenizer
from mmformer.tokenizers.audio import ASTPatchTokenizer, LogMel
from mmformer.tokenizers.text import TextEmbedding
from tests.tasks.lm_loss_parity import assert_same_loss_and_gradients, spy_chunked_loss

V, BOS, EOS = 5, 3, 2
NAMES = PrefixLM("audio", "text", "lm")


def _model(prefix: str = "audio", max_len: int | None = 16, positions: str = "none", seed: int = 0):
    torch.manual_seed(seed)
    D = 32
    if prefix == "audio":
        tok = ASTPatchTokenizer(
            D, LogMel(8000, 200, 80, 16, normalize="utterance"), (8, 4), (8, 4), max_frames=101
        )
    else:
        tok = ViTPatchTokenizer(D, image_size=8, patch_size=4, in_chans=1, mean=(0.5,), std=(0.5,))
    backbone = build_backbone(D, 2, AttentionConfig(2), positions=PositionConfig(positions), causal=True)
    model = MultimodalModel(
        {prefix: tok, "text": TextEmbedding(V, D, max_len)}, backbone, {"lm": LMHead(D, V)}
    )
    for p in model.parameters():  # sharper distributions than the 0.02 init, so decoding choices differ
        p.data.normal_(0, 0.5)
    return model.eval()


def _waves(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    wave = torch.randn(len(lengths), max(lengths), generator=g)
    valid = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    return wave * valid, valid


@torch.no_grad()
def _seq_logprob(model, names, wave, valid, seq: list[int]) -> float:
    """log p(seq | prefix) from one teacher-forced forward (no cache)."""
    ids = torch.tensor([[BOS, *seq]])
    logits = names.logits(model, wave, ids, torch.ones_like(ids, dtype=torch.bool), prefix_valid=valid)
    logp = logits[0, :-1].float().log_softmax(-1)
    return float(sum(logp[i, t] for i, t in enumerate(seq)))


@torch.no_grad()
def _greedy_by_recomputation(names, model, wave, valid, steps: int) -> list[int]:
    """Greedy decoding of one item by a full teacher-forced forward per step (no cache)."""
    seq = [BOS]
    for _ in range(steps):
        ids = torch.tensor([seq])
        logits = names.logits(model, wave, ids, torch.ones_like(ids, dtype=torch.bool), prefix_valid=valid)
        nxt = int(logits[0, -1].argmax())
        if nxt == EOS:
            break
        seq.append(nxt)
    return seq[1:]


def test_prefix_is_bidirectional_and_text_causal():
    model = _model()
    wave, valid = _waves([800])
    ids = torch.tensor([[BOS, 0, 1, 4, 0]])
    ones = torch.ones_like(ids, dtype=torch.bool)
    base = NAMES.logits(model, wave, ids, ones, prefix_valid=valid)
    later = ids.clone()
    later[0, 3:] = 1  # changing text tokens 3… changes nothing before them
    out = NAMES.logits(model, wave, later, ones, prefix_valid=valid)
    torch.testing.assert_close(out[0, :3], base[0, :3])
    assert not torch.allclose(out[0, 3:], base[0, 3:])
    # the end of the clip reaches the first text position (the prefix is read whole)
    wave2 = wave.clone()
    wave2[0, 700:] += 1.0
    assert not torch.allclose(NAMES.logits(model, wave2, ids, ones, prefix_valid=valid)[0, 0], base[0, 0])
    # and inside the prefix, early tokens see late ones (bidirectional span)
    prefix = NAMES.prefix(model, wave, valid)
    seq, span = NAMES._join(model, prefix, model.tokenizers["text"](ids))
    hidden = model.backbone(seq, span=span)
    seq2, _ = NAMES._join(model, NAMES.prefix(model, wave2, valid), model.tokenizers["text"](ids))
    assert not torch.allclose(model.backbone(seq2, span=span)[0, 0], hidden[0, 0])


def test_loss_counts_caption_tokens_only():
    ids = torch.tensor([[BOS, 0, 1, EOS, 4], [BOS, 1, EOS, 4, 4]])
    valid = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    assert caption_targets(ids, valid).tolist() == [[0, 1, EOS, -100], [1, EOS, -100, -100]]


@pytest.mark.parametrize("prefix", ["audio", "image"])
def test_training_loss_never_holds_the_logits_yet_equals_them(prefix, monkeypatch):
    """The caption's loss is computed a few rows at a time (``heads.token_cross_entropy``): the loss and
    every parameter's gradient, the prefix tokenizer's included, as from the full text logits."""
    model = _model(prefix, positions="rope").train()
    model.heads["lm"].chunk_rows = 3  # several chunks, the last one short
    inputs, valid = _waves([400, 640]) if prefix == "audio" else (torch.rand(2, 1, 8, 8), None)
    caption = torch.tensor([[BOS, 0, 1, EOS], [BOS, 2, EOS, 0]])
    caption_valid = torch.tensor([[True] * 4, [True, True, True, False]])
    batch = {prefix: inputs, "caption": caption, "caption_valid": caption_valid}
    if valid is not None:
        batch[f"{prefix}_valid"] = valid
    task = PrefixLMTask(NAMES if prefix == "audio" else PrefixLM("image", "text", "lm"), prefix, _Text(), 4)
    calls = spy_chunked_loss(monkeypatch)
    loss = task.training_loss(model, batch)
    assert calls  # the chunked path ran
    logits = task.parts.logits(model, inputs, caption, caption_valid, valid)[:, :-1]
    targets = caption_targets(caption, caption_valid)
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert_same_loss_and_gradients(model, loss, want)


@pytest.mark.parametrize("positions", ["none", "rope"])
def test_greedy_with_the_cache_equals_argmax_of_full_forwards(positions):
    model = _model(positions=positions, max_len=None if positions == "rope" else 16)
    wave, valid = _waves([640, 800, 400])
    out = NAMES.generate(model, wave, BOS, EOS, max_new_tokens=6, prefix_valid=valid)
    for b in range(3):
        assert out[b] == _greedy_by_recomputation(NAMES, model, wave[b : b + 1], valid[b : b + 1], 6)


def test_beam_search_finds_the_most_likely_text_exhaustively():
    """With length_penalty 0 and a beam wider than every step's candidates, beam search is exact: its
    text is the argmax of log p over every text of at most 3 tokens (ending in eos or cut at 3)."""
    model = _model(seed=3)
    wave, valid = _waves([720], seed=3)
    texts = []
    for n in range(0, 4):
        for body in itertools.product([t for t in range(V) if t != EOS], repeat=n):
            texts.append((list(body), [*body, EOS]))  # ends with eos ...
            if n == 3:
                texts.append((list(body), list(body)))  # ... or is cut at max_new_tokens
    scored = [(_seq_logprob(model, NAMES, wave, valid, seq), body) for body, seq in texts if len(seq) <= 3]
    best = max(scored)[1]
    got = NAMES.generate(model, wave, BOS, EOS, 3, beam_size=200, length_penalty=0.0, prefix_valid=valid)
    assert got == [best]
    greedy = NAMES.generate(model, wave, BOS, EOS, 3, prefix_valid=valid)
    assert (
        NAMES.generate(model, wave, BOS, EOS, 3, beam_size=1, length_penalty=0.0, prefix_valid=valid)
        == greedy
    )


@pytest.mark.parametrize("beam_size", [1, 3])
def test_batched_decoding_equals_one_at_a_time(beam_size):
    model = _model(seed=1)
    wave, valid = _waves([300, 800, 560], seed=1)  # padded prefixes of different lengths
    batched = NAMES.generate(model, wave, BOS, EOS, 5, beam_size=beam_size, prefix_valid=valid)
    for b in range(3):
        n = int(valid[b].sum())
        alone = NAMES.generate(
            model, wave[b : b + 1, :n], BOS, EOS, 5, beam_size=beam_size, prefix_valid=valid[b : b + 1, :n]
        )
        assert batched[b] == alone[0]


def test_image_prefix_and_learned_text_positions_stop_at_max_len():
    model = _model(prefix="image", max_len=4)
    names = PrefixLM("image", "text", "lm")
    images = torch.randint(0, 255, (2, 1, 8, 8), dtype=torch.uint8)
    out = names.generate(model, images, BOS, None, max_new_tokens=10)
    assert [len(o) for o in out] == [3, 3]  # bos + 3 tokens fill the 4 learned positions
    with pytest.raises(ValueError, match="beam_size"):
        names.generate(model, images, BOS, EOS, 3, beam_size=0)


def test_non_causal_backbone_is_refused():
    model = _model()
    model.backbone.causal = False
    wave, valid = _waves([400])
    with pytest.raises(ValueError, match="causal"):
        NAMES.generate(model, wave, BOS, EOS, 2, prefix_valid=valid)


class _Text:
    bos_id, eos_id = BOS, EOS

    def decode(self, ids, skip_special=False):
        return " ".join("abcde"[i] for i in ids)


def test_metrics_on_known_strings():
    assert normalize_text("Flag: United_States!  ") == "flag united states"
    assert normalize_text("Please, press 1 — it's FREE.") == "please press 1 it's free"
    task = PrefixLMTask(NAMES, "audio", _Text(), max_new_tokens=3)
    task.val_metrics["wer"].update(["a b c", "d"], ["a x c", "d e"])  # 1 substitution + 1 deletion / 5 words
    assert float(task.val_metrics["wer"].compute()) == pytest.approx(2 / 5)


def test_validation_decodes_and_scores_the_held_out_text():
    model = _model(seed=2)
    wave, valid = _waves([400, 640], seed=2)
    task = PrefixLMTask(NAMES, "audio", _Text(), max_new_tokens=4)
    hyps = task.transcribe(model, wave, valid)
    batch = {
        "audio": wave,
        "audio_valid": valid,
        "caption": torch.tensor([[BOS, 0, EOS], [BOS, 1, EOS]]),
        "caption_valid": torch.ones(2, 3, dtype=torch.bool),
        "caption_text": [hyps[0].upper(), "zz"],  # the first decoded exactly (after normalisation)
    }
    task.validation_update(model, batch)
    assert float(task.val_metrics["exact_match"].compute()) == pytest.approx(0.5)
    assert task.examples[0] == (normalize_text(hyps[0]), normalize_text(hyps[0]))
    assert torch.isfinite(task.val_metrics["loss"].compute())


# ------------------------------------------------------------------ encoder → LLM bridge (projector)
def test_projector_stacks_frames_exactly_and_ignores_padding():
    from mmformer.models.heads import ProjectorHead
    from mmformer.nn.tokens import Tokens

    torch.manual_seed(0)
    head = ProjectorHead(4, 6, stack=2, hidden=5)
    h = torch.randn(2, 5, 4)
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    tokens = Tokens.from_embeddings(h, 0, valid=valid)
    tokens.modality = torch.full((2, 5), 2)
    out = head(h, tokens)
    assert out.x.shape == (2, 3, 6)
    assert out.valid.tolist() == [[True, True, True], [True, True, False]]
    assert out.modality.tolist() == [[2, 2, 2], [2, 2, 2]]

    # token j = fc2(gelu(fc1([h[2j], h[2j+1]]))), the missing / padded half read as zeros
    def mlp(x):
        return head.fc2(torch.nn.functional.gelu(head.fc1(x)))

    torch.testing.assert_close(out.x[0, 1], mlp(torch.cat([h[0, 2], h[0, 3]])))
    torch.testing.assert_close(out.x[0, 2], mlp(torch.cat([h[0, 4], torch.zeros(4)])))
    torch.testing.assert_close(out.x[1, 1], mlp(torch.cat([h[1, 2], torch.zeros(4)])))
    garbage = h.clone()
    garbage[1, 3:] = 1e3  # padding never reaches a real token
    torch.testing.assert_close(head(garbage, tokens).x[1, :2], out.x[1, :2])


def _bridged(seed=0):
    from mmformer.models.heads import ProjectorHead

    torch.manual_seed(seed)
    D_enc, D = 24, 32
    tok = ASTPatchTokenizer(
        D_enc, LogMel(8000, 200, 80, 16, normalize="utterance"), (8, 4), (8, 4), max_frames=101
    )
    model = MultimodalModel(
        {"audio": tok, "text": TextEmbedding(V, D, 16)},
        build_backbone(D, 2, AttentionConfig(2), causal=True),
        {"lm": LMHead(D, V), "bridge": ProjectorHead(D_enc, D, stack=3)},
        towers={"audio": build_backbone(D_enc, 1, AttentionConfig(2))},
    )
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    return model.eval(), PrefixLM("audio", "text", "lm", "bridge")


def test_bridged_decoding_equals_recomputation_and_batches_like_one_at_a_time():
    model, names = _bridged(seed=2)
    wave, valid = _waves([300, 800, 560], seed=2)
    out = names.generate(model, wave, BOS, EOS, 4, prefix_valid=valid)
    for b in range(3):
        n = int(valid[b].sum())
        w, v = wave[b : b + 1, :n], valid[b : b + 1, :n]
        assert names.generate(model, w, BOS, EOS, 4, prefix_valid=v)[0] == out[b]
        assert out[b] == _greedy_by_recomputation(names, model, w, v, 4)


def test_bridge_trains_only_the_projector_when_encoder_and_llm_are_frozen():
    model, names = _bridged()
    model.train()
    for part in (model.tokenizers, model.towers, model.backbone, model.heads["lm"]):
        part.requires_grad_(False)
    wave, valid = _waves([400, 800])
    ids = torch.tensor([[BOS, 1, 0, EOS], [BOS, 4, EOS, 0]])
    text_valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    logits = names.logits(model, wave, ids, text_valid, prefix_valid=valid)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    loss.backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert trained == {n for n, _ in model.named_parameters() if n.startswith("heads.bridge.")}
