"""The seq2seq task (encoder–decoder speech recognition): the training loss is the teacher-forced
cross-entropy on the transcript tokens, validation decodes through the KV cache and scores the text,
and recipe mistakes name the key to fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmformer.models import AttentionConfig, BlockConfig, MultimodalModel, build_backbone
from mmformer.models.encoder_decoder import EncoderDecoder
from mmformer.models.heads import LMHead
from mmformer.tasks.prefix_lm import caption_targets, normalize_text
from mmformer.tasks.seq2seq import Seq2SeqTask
from mmformer.tokenizers.audio import ASTPatchTokenizer, LogMel
from mmformer.tokenizers.text import TextEmbedding
from tests.tasks.lm_loss_parity import assert_same_loss_and_gradients, spy_chunked_loss

V, BOS, EOS = 6, 4, 5
PARTS = EncoderDecoder("audio", "text", "lm")


class _Text:  # the data-side tokenizer's decoding interface
    bos_id, eos_id = BOS, EOS

    def decode(self, ids, skip_special=False):
        return " ".join("abcd"[i] for i in ids if i < 4)


def _model(seed=0):
    torch.manual_seed(seed)
    tok = ASTPatchTokenizer(
        24, LogMel(8000, 200, 80, 16, normalize="utterance"), (8, 4), (8, 4), max_frames=101
    )
    model = MultimodalModel(
        {"audio": tok, "text": TextEmbedding(V, 32, 16)},
        build_backbone(32, 2, AttentionConfig(2), block=BlockConfig("cross", d_context=24), causal=True),
        {"lm": LMHead(32, V)},
        {"audio": build_backbone(24, 2, AttentionConfig(2))},
    )
    for p in model.parameters():  # sharper distributions than the 0.02 init, so decoding choices differ
        p.data.normal_(0, 0.5)
    return model.eval()


def _batch():
    g = torch.Generator().manual_seed(0)
    valid = torch.arange(640)[None, :] < torch.tensor([400, 640])[:, None]
    return {
        "audio": torch.randn(2, 640, generator=g) * valid,
        "audio_valid": valid,
        "caption": torch.tensor([[BOS, 0, 1, EOS], [BOS, 2, EOS, 0]]),
        "caption_valid": torch.tensor([[True] * 4, [True, True, True, False]]),
    }


def test_training_loss_is_teacher_forced_cross_entropy_on_the_transcript():
    model, batch = _model(), _batch()
    task = Seq2SeqTask(PARTS, "audio", _Text(), max_new_tokens=4)
    logits = PARTS.logits(
        model, batch["audio"], batch["caption"], batch["caption_valid"], batch["audio_valid"]
    )
    targets = [(0, 0, 0), (0, 1, 1), (0, 2, EOS), (1, 0, 2), (1, 1, EOS)]  # (row, position, next token)
    want = torch.stack([F.cross_entropy(logits[b, t], torch.tensor(y)) for b, t, y in targets]).mean()
    assert task.training_loss(model, batch).item() == pytest.approx(want.item(), rel=1e-5)
    assert task.loss_units(batch) == 5


def test_training_loss_never_holds_the_logits_yet_equals_them(monkeypatch):
    """The decoder's LM head computes the loss a few rows at a time (``heads.token_cross_entropy``):
    the loss and every parameter's gradient, the encoder's included, as from the full logits."""
    model, batch = _model().train(), _batch()
    model.heads["lm"].chunk_rows = 3  # several chunks, the last one short
    task = Seq2SeqTask(PARTS, "audio", _Text(), max_new_tokens=4)
    calls = spy_chunked_loss(monkeypatch)
    loss = task.training_loss(model, batch)
    assert calls  # the chunked path ran
    args = batch["audio"], batch["caption"], batch["caption_valid"], batch["audio_valid"]
    logits = PARTS.logits(model, *args)[:, :-1]
    targets = caption_targets(batch["caption"], batch["caption_valid"], task.prompt_len)
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert_same_loss_and_gradients(model, loss, want)


def test_validation_decodes_through_the_cache_and_scores_the_text():
    model, batch = _model(seed=2), _batch()
    task = Seq2SeqTask(PARTS, "audio", _Text(), max_new_tokens=4)
    hyps = task.transcribe(model, batch["audio"], batch["audio_valid"])
    ids = PARTS.generate(model, batch["audio"], BOS, EOS, 4, source_valid=batch["audio_valid"])
    assert hyps == [_Text().decode(x) for x in ids] and any(hyps)
    task.validation_update(model, {**batch, "caption_text": [hyps[0].upper(), "zz"]})
    assert float(task.val_metrics["exact_match"].compute()) == pytest.approx(0.5)
    assert task.examples[0] == (normalize_text(hyps[0]), normalize_text(hyps[0]))


RECIPE = """
name: s2s
model:
  tokenizers:
    audio: {kind: ast, sample_rate: 8000, n_mels: 16, n_fft: 200, hop_length: 80,
            patch_size: [16, 8], patch_stride: [16, 8]}
    text: {kind: bpe, vocab_size: 300, max_len: 16}
  towers: TOWERS
  backbone: BACKBONE
  heads: {lm: {kind: lm}}
tasks:
  asr: {kind: seq2seq, tokenizer: audio, caption_tokenizer: text, caption_head: lm,
        data: {kind: audio_caption, root: asterisk-speech, max_len: 16}}
trainer: {max_steps: 1}
"""
TOWER = "{audio: {d_model: 32, n_layers: 1, n_heads: 2}}"
DECODER = "{d_model: 32, n_layers: 1, n_heads: 2, block: cross, causal: true}"


@pytest.mark.parametrize(
    "towers, backbone, message",
    [
        ("{}", DECODER, "add model.towers.audio"),
        (TOWER, "{d_model: 32, n_layers: 1, n_heads: 2, causal: true}", "block: cross and causal: true"),
        (TOWER, "{d_model: 32, n_layers: 1, n_heads: 2, block: cross}", "block: cross and causal: true"),
        ("{audio: {d_model: 16, n_layers: 1, n_heads: 2}}", DECODER, "set model.backbone.d_context: 16"),
        (TOWER, "{kind: pretrained, source: smollm2-135m-instruct}", "set model.backbone.part: decoder"),
    ],
)
def test_recipe_mistakes_name_the_key(towers, backbone, message):
    from mmformer.recipe import RecipeError, recipe_from_yaml

    with pytest.raises(RecipeError, match=message):  # every rule runs when the recipe loads
        recipe_from_yaml(RECIPE.replace("TOWERS", towers).replace("BACKBONE", backbone))
