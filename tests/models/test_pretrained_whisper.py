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
