"""Audio tokenizers and decoding: padding changes nothing, edge cases (silence, 10 ms, 30 s, sample
rates, stereo, corrupt files), and the log-mel against torchaudio's own transforms."""

import math

import numpy as np
import pytest
import soundfile as sf
import torch

from mmformer.data.audio import AudioClips, collate_audio
from mmformer.tokenizers.audio import (
    ASTPatchTokenizer,
    AudioDecodeError,
    AudioPreprocess,
    LogMel,
    SpecAugment,
    WhisperConvTokenizer,
)


def _ast(d=32, normalize="fixed", **kw):
    torch.manual_seed(0)
    mel = LogMel(8000, 200, 80, 32, normalize=normalize)
    return ASTPatchTokenizer(d, mel, (16, 16), (16, 8), max_frames=301, **kw).eval()


def _pad(clips):
    wave = torch.full((len(clips), max(len(c) for c in clips)), 7.0)  # garbage in the padding
    valid = torch.zeros(wave.shape, dtype=torch.bool)
    for i, c in enumerate(clips):
        wave[i, : len(c)], valid[i, : len(c)] = c, True
    return wave, valid


@pytest.mark.parametrize(
    "make",
    [_ast, lambda: _ast(normalize="utterance"), lambda: WhisperConvTokenizer(32).eval()],
    ids=["ast", "ast-utterance-norm", "whisper"],
)
def test_a_clip_gives_the_same_tokens_alone_and_in_a_padded_batch(make):
    tok = make()
    g = torch.Generator().manual_seed(1)
    clips = [torch.randn(n, generator=g) * 0.1 for n in (8000, 3001, 80)]  # 80 samples = 10 ms at 8 kHz
    batch = tok(*_pad(clips))
    for i, c in enumerate(clips):
        alone = tok(c[None])
        n = alone.x.shape[1]
        assert alone.valid.all() and int(batch.valid[i].sum()) == n
        torch.testing.assert_close(batch.x[i, :n], alone.x[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(batch.positions[i, :n], alone.positions[0])


def test_log_mel_matches_torchaudio_and_silence_is_finite():
    import torchaudio

    mel = LogMel(16000, 400, 160, 80)
    wave = torch.randn(2, 16000) * 0.1
    want = torchaudio.transforms.MelSpectrogram(
        16000, n_fft=400, hop_length=160, n_mels=80, pad_mode="constant"
    )(wave)
    got, frames = mel(wave)
    torch.testing.assert_close(got, (want.clamp_min(1e-10).log10() + 4) / 4)
    assert frames.shape == (2, 16000 // 160 + 1) and frames.all()
    silent, _ = mel(torch.zeros(1, 16000))
    assert torch.isfinite(silent).all() and torch.allclose(
        silent, torch.tensor(-1.5)
    )  # (log10(1e-10) + 4) / 4


def test_ten_millisecond_and_silent_clips_give_finite_tokens():
    tok = _ast()
    for clip in (torch.zeros(1, 80), torch.randn(1, 80)):
        out = tok(clip)
        assert out.x.shape[1] == tok.n_freq and out.valid.all() and torch.isfinite(out.x).all()


def test_thirty_second_clip_whisper_fills_its_context_and_ast_refuses_beyond_max_frames():
    w = WhisperConvTokenizer(16).eval()
    assert w(torch.zeros(1, 30 * 16000)).x.shape[1] == 1500
    with pytest.raises(ValueError, match="1500 positions"):
        w(torch.zeros(1, 31 * 16000))
    with pytest.raises(ValueError, match="max_frames"):
        _ast()(torch.zeros(1, 30 * 8000))  # max_frames 301 = 3 s at 8 kHz, hop 80
    pre = AudioPreprocess(8000, max_seconds=3.0)
    assert pre.crop(torch.zeros(30 * 8000)).shape == (24000,)  # the data side crops first


def test_spec_augment_masks_in_training_only():
    aug = SpecAugment(freq_mask=8, time_mask=10)
    mel = torch.randn(4, 32, 50)
    assert torch.equal(aug.eval()(mel), mel)
    torch.manual_seed(0)
    masked = aug.train()(mel)
    assert (masked == 0).any() and masked.shape == mel.shape


@pytest.mark.parametrize("rate,seconds", [(8000, 1.0), (44100, 1.0), (48000, 0.5), (44100, 1001 / 44100)])
def test_resampling_gives_exact_lengths(tmp_path, rate, seconds):
    n = round(rate * seconds)
    path = tmp_path / "clip.wav"
    sf.write(path, np.sin(np.arange(n) * 2 * math.pi * 440 / rate).astype(np.float32), rate)
    wave = AudioPreprocess(16000, max_seconds=10).load(path)
    assert wave.shape == (math.ceil(n * 16000 / rate),) and wave.dtype == torch.float32
    if rate == 8000:  # a 440 Hz tone survives resampling
        spec = torch.fft.rfft(wave).abs()
        assert abs(int(spec.argmax()) * 16000 / len(wave) - 440) < 2


@pytest.mark.parametrize("fmt", ["wav", "flac", "ogg"])
def test_formats_decode_and_stereo_is_downmixed(tmp_path, fmt):
    left = np.linspace(-0.5, 0.5, 1600, dtype=np.float32)
    right = np.full(1600, 0.25, dtype=np.float32)
    path = tmp_path / f"stereo.{fmt}"
    sf.write(path, np.stack([left, right], axis=1), 16000)
    wave = AudioPreprocess(16000).load(path)
    tol = 1e-3 if fmt != "ogg" else 0.05  # ogg vorbis is lossy
    assert wave.shape == (1600,) and np.abs(wave.numpy() - (left + right) / 2).max() < tol


def test_corrupt_file_is_reported_with_its_path_skipped_and_counted(tmp_path):
    good, bad = tmp_path / "good.wav", tmp_path / "bad.wav"
    sf.write(good, np.zeros(800, dtype=np.float32), 8000)
    bad.write_bytes(b"RIFF\x00\x00not really a wav file")
    with pytest.raises(AudioDecodeError, match="bad.wav"):
        AudioPreprocess(8000).load(bad)
    data = AudioClips([(str(bad), 0), (str(good), 1)], AudioPreprocess(8000))
    item = data[0]
    assert item["label"] == 1 and item["bad_samples"] == [str(bad)]
    batch = collate_audio([item, data[1]])
    assert batch["bad_samples"] == [str(bad)] and batch["audio_valid"].all()


def test_utterance_normalisation_removes_level_and_channel_gain():
    mel = LogMel(8000, 200, 80, 32, normalize="utterance")
    wave = torch.randn(1, 8000) * 0.1
    a, frames = mel(wave)
    b, _ = mel(wave * 5.0)  # +14 dB
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    assert a[0].mean(-1).abs().max() < 1e-4 and (a[0].std(-1, unbiased=False) - 1).abs().max() < 1e-3


def test_training_augmentation_gain_shift_noise():
    torch.manual_seed(0)
    pre = AudioPreprocess(8000, 2.0, gain_db=6.0, shift_seconds=0.25, noise_snr_db=20.0)
    wave = torch.sin(torch.arange(4000) * 0.3)
    out = pre.augment(wave)
    shift = out.shape[0] - wave.shape[0]
    assert 0 <= shift <= 2000
    gain = (out[shift:] @ wave) / (wave @ wave)  # noise is uncorrelated with the tone
    assert 10 ** (-6.5 / 20) < gain < 10 ** (6.5 / 20)
    assert torch.equal(AudioPreprocess(8000).augment(wave), wave)  # all off by default
