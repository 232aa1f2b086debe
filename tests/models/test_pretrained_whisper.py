"""Whisper tiny.en's encoder imported from its CTranslate2 files equals CTranslate2's own encoder, and
its log-mel equals faster-whisper's feature extractor, on a real recording."""

import importlib.util
import os

import numpy as np
import pytest
import torch

from mmformer.models.pretrained import load_pretrained, resolve_pretrained
from mmformer.models.pretrained.ctranslate2 import read_ctranslate2
from mmformer.tokenizers.audio import AudioPreprocess

CLIP = "/usr/share/asterisk/sounds/en/digits/7.wav"


@pytest.fixture(scope="module")
def whisper():
    path = resolve_pretrained(
        "whisper-tiny.en"
    )  # `make install` installs it; else the error names the command
    p = load_pretrained("whisper-tiny.en")
    p.model.eval()
    return path, p


@pytest.fixture(scope="module")
def thirty_seconds():
    if not os.path.isfile(CLIP):
        pytest.skip("needs the Asterisk recordings (apt-get install asterisk-core-sounds-en-wav)")
    wave = AudioPreprocess(16000, 30).load(CLIP)  # a real 8 kHz recording, resampled to 16 kHz
    full = torch.zeros(1, 30 * 16000)
    full[0, : len(wave)] = wave  # Whisper's pad_or_trim
    return full


def _faster_whisper_features():
    spec = importlib.util.find_spec("faster_whisper")  # installed --no-deps by `make install`
    # its package __init__ imports PyAV and onnxruntime; the feature extractor itself needs numpy only
    path = os.path.join(os.path.dirname(spec.origin), "feature_extractor.py")
    module_spec = importlib.util.spec_from_file_location("faster_whisper_features", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.FeatureExtractor(feature_size=80)


@pytest.mark.slow
def test_log_mel_matches_faster_whisper(whisper, thirty_seconds):
    _, p = whisper
    want = _faster_whisper_features()(thirty_seconds[0].numpy(), padding=0)  # (80, 3000)
    got, frames = p.model.tokenizers["audio"].mel(thirty_seconds)
    assert got.shape == (1, 80, 3000) and frames.all()
    assert np.abs(got[0].numpy() - want).max() < 1e-4


def test_log_mel_matches_faster_whisper_when_the_clip_starts_loud(whisper):
    _, p = whisper
    t = torch.arange(16000 * 2) / 16000
    tone = torch.zeros(1, 30 * 16000)
    tone[0, : len(t)] = 0.5 * torch.sin(2 * torch.pi * 440 * t)  # loud from the first sample: the edge counts
    want = _faster_whisper_features()(tone[0].numpy(), padding=0)
    got, _ = p.model.tokenizers["audio"].mel(tone)
    assert np.abs(got[0].numpy() - want).max() < 1e-4


@pytest.mark.slow
def test_encoder_matches_ctranslate2(whisper, thirty_seconds):
    import ctranslate2

    path, p = whisper
    features, _ = p.model.tokenizers["audio"].mel(thirty_seconds)
    reference = ctranslate2.models.Whisper(str(path), device="cpu", compute_type="float32")
    want = np.array(reference.encode(ctranslate2.StorageView.from_array(features.numpy()), to_cpu=True))
    with torch.no_grad():
        got, tokens = p.model.encode("audio", thirty_seconds)
    assert got.shape == want.shape == (1, 1500, 384) and tokens.valid.all()
    assert np.abs(got.numpy() - want).max() < 1e-3


def test_reader_refuses_a_file_that_is_not_ctranslate2(tmp_path):
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"\xff\xff\xff\x7f" + b"\0" * 16)
    with pytest.raises(ValueError, match="not a CTranslate2 model"):
        read_ctranslate2(bad)


# ----------------------------------------------------------------------------- the whole model
SAMPLE = [  # real recordings: a single word, short prompts, and one long enough to hit the token limit
    "digits/7.wav",
    "agent-loggedoff.wav",
    "call-fwd-unconditional.wav",
    "conf-usermenu.wav",
]


@pytest.fixture(scope="module")
def whisper_full():
    from mmformer.models.pretrained.whisper import load_whisper

    model, tok, config = load_whisper(resolve_pretrained("whisper-tiny.en"))
    return model.eval(), tok, config


def test_full_model_parts_and_decoding_rules(whisper_full):
    from mmformer.models.pretrained.whisper import whisper_prompt

    model, tok, config = whisper_full
    assert model.heads["lm"].head.weight is model.tokenizers["text"].embed.weight  # tied, as Whisper
    assert len(model.backbone.blocks) == 4 and model.backbone.causal
    assert whisper_prompt(tok, config) == [50257, 50362]  # <|startoftranscript|> <|notimestamps|>
    assert tok.eos_id == 50256 and config["suppress_ids_begin"] == [220, 50256]
    assert len(config["suppress_ids"]) == 90


@pytest.mark.slow
def test_transcripts_equal_ctranslate2(whisper_full):
    """Greedy decoding of real recordings gives CTranslate2's token ids exactly (faster-whisper's engine,
    its default suppression rules: ``suppress_tokens=[-1]``, ``suppress_blank=True``)."""
    import ctranslate2

    from mmformer.models.pretrained.whisper import WHISPER, whisper_prompt

    paths = [f"/usr/share/asterisk/sounds/en/{name}" for name in SAMPLE]
    if not all(os.path.isfile(p) for p in paths):
        pytest.skip("needs the Asterisk recordings (apt-get install asterisk-core-sounds-en-wav)")
    model, tok, config = whisper_full
    waves = torch.zeros(len(paths), 30 * 16000)
    for i, path in enumerate(paths):
        wave = AudioPreprocess(16000, 30).load(path)
        waves[i, : len(wave)] = wave
    prompt = whisper_prompt(tok, config)
    got = WHISPER.generate(
        model,
        waves,
        prompt,
        tok.eos_id,
        max_new_tokens=24,
        suppress=config["suppress_ids"],
        suppress_begin=config["suppress_ids_begin"],
    )
    features, _ = model.tokenizers["audio"].mel(waves)
    reference = ctranslate2.models.Whisper(str(resolve_pretrained("whisper-tiny.en")), device="cpu")
    want = reference.generate(
        ctranslate2.StorageView.from_array(features.numpy()),
        [[tok.tokenizer.id_to_token(t) for t in prompt]] * len(paths),
        beam_size=1,
        max_length=48,  # CTranslate2 decodes at most max_length / 2 new tokens
    )
    assert got == [w.sequences_ids[0] for w in want]
    texts = [tok.decode(ids, skip_special=True).strip() for ids in got]
    assert texts[0] == "7." and len(got[3]) == 24  # the long prompt reaches the limit
