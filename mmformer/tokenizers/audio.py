"""Audio tokenizers: waveforms → log-mel spectrograms → Tokens.

Two halves (DESIGN.md):
  * data side — ``AudioPreprocess``: decode a file with soundfile (wav, flac, ogg), downmix to mono,
    resample to the recipe's ``sample_rate`` with torchaudio, crop to ``max_seconds``; float32 ``(S,)``.
  * model side, batched on the model's device:
      - ``LogMel``: torchaudio mel spectrogram → ``log10`` with a floor (digital silence stays finite)
        → fixed normalisation ``(log_mel - mean) / std``; frames are valid where the waveform is.
      - ``SpecAugment``: frequency and time masking (Park et al. 2019, arXiv:1904.08779), training only.
      - ``ASTPatchTokenizer``: 2-D patches over (frequency, time), overlap allowed, learned position
        embeddings, 2-D positions (AST, Gong et al. 2021, arXiv:2104.01778 §2.1).
      - ``WhisperConvTokenizer``: frame tokens through Whisper's two-conv stem with its fixed sinusoidal
        positions (Radford et al. 2022, arXiv:2212.04356 §2.2; ``whisper/model.py`` ``AudioEncoder``).

Padding never changes a clip's tokens: samples past a clip's length are zeroed, the STFT pads with
zeros (not reflection), and convolution outputs past the valid frames are zeroed before the next
layer, so a clip in a padded batch gives exactly the tokens it gives alone (tested).

Shape legend: B batch, S samples, F mel bins, T frames, N tokens, D width.
Mask convention: ``valid`` True = real sample / frame / token.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.tokens import MODALITY_IDS, Tokens


class AudioDecodeError(ValueError):
    """A file soundfile cannot read (missing, corrupt, unsupported); the message names the path."""


class AudioPreprocess:
    """Data side: ``load(path) → (S,) float32`` at ``sample_rate``, mono, at most ``max_seconds`` long.

    Args:
        sample_rate: target rate in Hz (resampled with ``torchaudio.functional.resample``, sinc
            interpolation; the output has ``ceil(S · sample_rate / orig_rate)`` samples).
        max_seconds: longer clips are cut (from the start, or at a random offset with ``random_crop``).
        gain_db, shift_seconds, noise_snr_db: training augmentation (``augment``; off by default).
    Raises ``AudioDecodeError`` naming the file when soundfile cannot read it.
    """

    def __init__(
        self,
        sample_rate: int = 16_000,
        max_seconds: float = 10.0,
        random_crop: bool = False,
        gain_db: float = 0.0,
        shift_seconds: float = 0.0,
        noise_snr_db: float | None = None,
    ):
        self.sample_rate, self.max_seconds, self.random_crop = sample_rate, max_seconds, random_crop
        self.gain_db, self.shift_seconds, self.noise_snr_db = gain_db, shift_seconds, noise_snr_db

    def augment(self, wave: Tensor) -> Tensor:
        """Training augmentation: a random gain in ±``gain_db`` dB, 0 to ``shift_seconds`` of leading
        silence, and white noise at a random SNR between ``noise_snr_db`` and 40 dB (each off at 0 / None)."""
        if self.gain_db:
            wave = wave * 10 ** (float(torch.empty(()).uniform_(-self.gain_db, self.gain_db)) / 20)
        if self.shift_seconds:
            pad = int(torch.randint(0, int(self.shift_seconds * self.sample_rate) + 1, ()))
            wave = F.pad(wave, (pad, 0))
        if self.noise_snr_db is not None:
            snr = float(torch.empty(()).uniform_(self.noise_snr_db, 40.0))
            power = wave.pow(2).mean().clamp_min(1e-10)
            wave = wave + torch.randn_like(wave) * (power / 10 ** (snr / 10)).sqrt()
        return wave

    @property
    def max_samples(self) -> int:
        return int(round(self.max_seconds * self.sample_rate))

    def decode(self, path) -> tuple[Tensor, int]:
        """The file's samples ``(S,)`` float32 in [-1, 1], channels averaged, and its rate. ``path``: a
        path, or a binary file object (a member of a shard)."""
        import soundfile

        try:
            source = path if hasattr(path, "read") else str(path)
            data, rate = soundfile.read(source, dtype="float32", always_2d=True)  # (S, C)
        except Exception as e:  # soundfile raises LibsndfileError / RuntimeError / TypeError
            raise AudioDecodeError(f"cannot decode audio {str(path)!r}: {e}") from None
        if data.shape[0] == 0:
            raise AudioDecodeError(f"audio file {str(path)!r} has no samples")
        return torch.from_numpy(data).mean(dim=1), int(rate)

    def resample(self, wave: Tensor, rate: int) -> Tensor:
        if rate == self.sample_rate:
            return wave
        import torchaudio.functional as AF

        return AF.resample(wave, rate, self.sample_rate)

    def crop(self, wave: Tensor) -> Tensor:
        n = self.max_samples
        if wave.shape[-1] <= n:
            return wave
        start = int(torch.randint(0, wave.shape[-1] - n + 1, ())) if self.random_crop else 0
        return wave[..., start : start + n]

    def load(self, path: str | Path) -> Tensor:
        """Decode, crop at the file's own rate (a little margin kept), resample, crop exactly."""
        wave, rate = self.decode(path)
        if rate != self.sample_rate:
            keep = math.ceil(self.max_seconds * rate) + 64  # no resampling work on audio that is cut anyway
            if wave.shape[0] > keep and not self.random_crop:
                wave = wave[:keep]
        return self.crop(self.augment(self.resample(wave, rate))).contiguous()


def frames_valid(valid_samples: Tensor, hop_length: int, n_frames: int) -> Tensor:
    """``(B,)`` valid sample counts → ``(B, T)`` frame mask: frame ``t`` (centred at ``t·hop``) is valid
    when its centre is a real sample — exactly the frames the clip has alone (``S // hop + 1``)."""
    n = torch.where(valid_samples > 0, valid_samples // hop_length + 1, 0)  # an empty row has no frames
    return torch.arange(n_frames, device=valid_samples.device) < n[:, None]


class LogMel(nn.Module):
    """``wave (B, S)`` → normalised log-mel ``(B, F, T)`` and its frame mask ``(B, T)``.

    Args:
        sample_rate (Hz), n_fft, hop_length (samples), n_mels, f_min, f_max (Hz; None = Nyquist).
        floor: power floor before ``log10`` (1e-10, as Whisper: silence → -10, never -inf).
        mean, std: fixed normalisation of the ``log10`` power (defaults give Whisper's ``(x + 4) / 4``).
        normalize: ``fixed`` (mean, std above) or ``utterance`` (each clip's own per-bin mean and
            variance over its real frames: robust to level and channel, e.g. telephone vs studio audio).
    """

    def __init__(
        self,
        sample_rate: int = 16_000,
        n_fft: int = 400,
        hop_length: int = 160,
        n_mels: int = 80,
        f_min: float = 0.0,
        f_max: float | None = None,
        floor: float = 1e-10,
        mean: float = -4.0,
        std: float = 4.0,
        normalize: str = "fixed",
    ):
        super().__init__()
        import torchaudio

        if normalize not in ("fixed", "utterance"):
            raise ValueError(f"normalize must be 'fixed' or 'utterance', got {normalize!r}")
        self.sample_rate, self.hop_length, self.n_mels = sample_rate, hop_length, n_mels
        self.floor, self.mean, self.std, self.normalize = floor, mean, std, normalize
        self.spectrogram = torchaudio.transforms.MelSpectrogram(
            sample_rate=sample_rate,
            n_fft=n_fft,
            hop_length=hop_length,
            n_mels=n_mels,
            f_min=f_min,
            f_max=f_max,
            power=2.0,
            center=True,
            pad_mode="constant",  # zeros past the end, as in a padded batch: padding changes nothing
        )

    def forward(self, wave: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if wave.dim() != 2:
            raise ValueError(f"audio must be (B, S) mono waveforms, got shape {tuple(wave.shape)}")
        counts = (
            valid.sum(1)
            if valid is not None
            else torch.full_like(wave[:, 0], wave.shape[1], dtype=torch.long)
        )
        if valid is not None:
            wave = wave * valid  # padded samples are exactly zero
        power = self.spectrogram(wave.float())  # (B, F, T), float32 even under autocast
        log_mel = power.clamp_min(self.floor).log10()
        frames = frames_valid(counts, self.hop_length, log_mel.shape[-1])
        if self.normalize == "fixed":
            return (log_mel - self.mean) / self.std, frames
        # per utterance and mel bin over the clip's own frames (cepstral mean and variance normalisation):
        # removes the channel's spectral tilt and the recording level; padding never enters the statistics
        w = frames[:, None, :].to(log_mel.dtype)  # (B, 1, T)
        n = w.sum(-1, keepdim=True).clamp_min(1.0)
        mu = (log_mel * w).sum(-1, keepdim=True) / n
        var = ((log_mel - mu).pow(2) * w).sum(-1, keepdim=True) / n
        return (log_mel - mu) / (var + 1e-5).sqrt(), frames


class SpecAugment(nn.Module):
    """Training-only frequency and time masking (torchaudio ``FrequencyMasking`` / ``TimeMasking``,
    independent masks per example) on a normalised log-mel ``(B, F, T)``; masked values become 0
    (the normalised mean). Identity in ``eval()``."""

    def __init__(self, freq_mask: int = 0, time_mask: int = 0, n_freq_masks: int = 2, n_time_masks: int = 2):
        super().__init__()
        import torchaudio

        self.freq = nn.ModuleList(
            [
                torchaudio.transforms.FrequencyMasking(freq_mask, iid_masks=True)
                for _ in range(n_freq_masks if freq_mask else 0)
            ]
        )
        self.time = nn.ModuleList(
            [
                torchaudio.transforms.TimeMasking(time_mask, iid_masks=True)
                for _ in range(n_time_masks if time_mask else 0)
            ]
        )

    def forward(self, mel: Tensor) -> Tensor:
        if not self.training or not (len(self.freq) or len(self.time)):
            return mel
        x = mel.unsqueeze(1)  # (B, 1, F, T): iid masks need a channel axis
        for mask in (*self.freq, *self.time):
            x = mask(x)
        return x.squeeze(1)


def ast_grid(
    n_mels: int, patch_size: tuple[int, int], patch_stride: tuple[int, int], max_frames: int
) -> tuple[int, int]:
    """``(frequency patches, most time patches)`` of an ``ASTPatchTokenizer``: its longest clip gives
    their product in tokens (patches start every ``stride`` bins / frames; a time patch exists for every
    start inside the ``max_frames`` frames)."""
    (pf, _), (sf, st) = patch_size, patch_stride
    return (n_mels - pf) // sf + 1, (max_frames - 1) // st + 1


class ASTPatchTokenizer(nn.Module):
    """Waveform → log-mel → 2-D patches (frequency × time) → Tokens, ordered time-major so that a
    shorter clip's tokens are a prefix (AST; overlapping patches when ``patch_stride < patch_size``).

    Frames past a clip's end read as silence (the log floor), and the spectrogram is padded with
    silence so every patch that starts inside the clip exists: a 10 ms clip gives one patch, and a
    clip's patches are the same alone or in a padded batch.

    Args:
        d_model: token width ``D``.
        mel: the ``LogMel`` front end (its ``n_mels`` is ``F``).
        patch_size, patch_stride: ``(frequency, time)`` in mel bins and frames.
        max_frames: longest spectrogram with a learned position embedding (``max_seconds · rate / hop + 1``).
        spec_augment: optional ``SpecAugment`` (training only).

    ``forward(wave (B, S) float, valid (B, S) bool | None) → Tokens`` with ``x (B, N, D)``, ``valid``
    True for patches that start inside the clip, positions ``(B, N, 2)`` = (frequency patch, time
    patch). Raises ``ValueError`` for a clip longer than ``max_frames``.
    """

    modality = "audio"
    num_prefix_tokens = 0

    def __init__(
        self,
        d_model: int,
        mel: LogMel,
        patch_size: tuple[int, int] = (16, 16),
        patch_stride: tuple[int, int] = (16, 16),
        max_frames: int = 1001,
        spec_augment: SpecAugment | None = None,
    ):
        super().__init__()
        (pf, pt), (sf, st) = patch_size, patch_stride
        if pf > mel.n_mels:
            raise ValueError(f"patch_size[0]={pf} exceeds n_mels={mel.n_mels}")
        self.mel, self.spec_augment = mel, spec_augment or SpecAugment()
        self.patch_size, self.patch_stride, self.max_frames = (pf, pt), (sf, st), max_frames
        self.n_freq, self.max_time = ast_grid(mel.n_mels, patch_size, patch_stride, max_frames)
        self.proj = nn.Conv2d(1, d_model, kernel_size=(pf, pt), stride=(sf, st))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.max_time * self.n_freq, d_model))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed"}

    @property
    def sample_rate(self) -> int:
        return self.mel.sample_rate

    @property
    def silence(self) -> float:
        """What frames past a clip read as: digital silence (``fixed``), or the clip's mean (``utterance``)."""
        if self.mel.normalize == "utterance":
            return 0.0
        return (math.log10(self.mel.floor) - self.mel.mean) / self.mel.std

    def example_input(self, batch_size: int = 1) -> Tensor:
        """Silence of the longest length (FLOP counting)."""
        return torch.zeros(batch_size, (self.max_frames - 1) * self.mel.hop_length)

    def forward(self, wave: Tensor, valid: Tensor | None = None) -> Tokens:
        mel, frame_valid = self.mel(wave, valid)  # (B, F, T), (B, T)
        pt, st = self.patch_size[1], self.patch_stride[1]
        n_frames = frame_valid.sum(1)  # (B,)
        if int(n_frames.max()) > self.max_frames:
            raise ValueError(
                f"a clip of {int(n_frames.max())} frames exceeds max_frames={self.max_frames}; raise max_seconds"
            )
        mel = self.spec_augment(mel).masked_fill(~frame_valid[:, None, :], self.silence)
        needed = (int(n_frames.max()) - 1) // st * st + pt  # frames for every patch starting inside a clip
        mel = F.pad(mel[..., :needed], (0, max(0, needed - mel.shape[-1])), value=self.silence)
        x = self.proj(mel.unsqueeze(1).to(self.proj.weight.dtype))  # (B, D, F', T')
        B, D, Fp, Tp = x.shape
        x = x.permute(0, 3, 2, 1).reshape(B, Tp * Fp, D)  # time-major: (t0,f0), (t0,f1), …
        x = x + self.pos_embed[:, : Tp * Fp]
        t_valid = (
            torch.arange(Tp, device=x.device) * st < n_frames[:, None]
        )  # the patch starts inside the clip
        tok_valid = t_valid.repeat_interleave(Fp, dim=1)  # (B, N)
        t_idx = torch.arange(Tp, device=x.device).repeat_interleave(Fp)
        f_idx = torch.arange(Fp, device=x.device).repeat(Tp)
        positions = torch.stack([f_idx, t_idx], dim=-1).unsqueeze(0).expand(B, -1, -1)
        return Tokens.from_embeddings(x, MODALITY_IDS["audio"], valid=tok_valid, positions=positions)


def whisper_sinusoids(length: int, channels: int, max_timescale: float = 10_000.0) -> Tensor:
    """Whisper's fixed positional embedding ``(length, channels)`` (``whisper/model.py`` ``sinusoids``)."""
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1)


class WhisperLogMel(nn.Module):
    """Whisper's log-mel exactly (``whisper/audio.py`` ``log_mel_spectrogram``): 16 kHz, 25 ms Hann
    window (n_fft 400), 10 ms hop, the last STFT frame dropped, Slaney mel filters, ``log10`` floored at
    1e-10, clamped to 8 below the clip's maximum (over its valid frames), then ``(x + 4) / 4``.
    ``forward(wave (B, S), valid (B, S) | None) → (mel (B, F, ⌈S / 160⌉), frame mask)``: the clip is
    zero-padded to whole hops, so a 30 s clip gives Whisper's 3,000 frames."""

    sample_rate, n_fft, hop_length = 16_000, 400, 160

    def __init__(self, n_mels: int = 80):
        super().__init__()
        import torchaudio

        self.n_mels = n_mels
        fb = torchaudio.functional.melscale_fbanks(
            self.n_fft // 2 + 1,
            0.0,
            self.sample_rate / 2,
            n_mels,
            self.sample_rate,
            norm="slaney",
            mel_scale="slaney",
        )  # (n_freqs, F), as librosa.filters.mel
        self.register_buffer("filters", fb.T.contiguous(), persistent=False)
        self.register_buffer("window", torch.hann_window(self.n_fft), persistent=False)

    def forward(self, wave: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        counts = (
            valid.sum(1)
            if valid is not None
            else torch.full_like(wave[:, 0], wave.shape[1], dtype=torch.long)
        )
        if valid is not None:
            wave = wave * valid
        # a whole number of hops (at least one, and at least n_fft / 2 + 1 samples for the reflection)
        half = self.n_fft // 2
        S = wave.shape[1] + (-wave.shape[1] % self.hop_length if wave.shape[1] else self.hop_length)
        wave = F.pad(wave, (0, max(S, half + 1) - wave.shape[1]))
        # Whisper's torch.stft(center=True) reflects the clip's first samples at the start; its end is the
        # zero padding of a 30 s window, i.e. zeros. The same here, per clip, so padding changes nothing.
        wave = torch.cat([wave[:, 1 : half + 1].flip(-1), wave, wave.new_zeros(wave.shape[0], half)], dim=1)
        stft = torch.stft(
            wave.float(), self.n_fft, self.hop_length, window=self.window, center=False, return_complex=True
        )
        stft = stft[..., : S // self.hop_length + 1]  # frames of the S-sample clip (min-length padding aside)
        power = stft[..., :-1].abs() ** 2  # (B, n_freqs, T), T = S // hop
        log_spec = (self.filters @ power).clamp_min(1e-10).log10()  # (B, F, T)
        n_valid = (counts + self.hop_length - 1) // self.hop_length  # frames centred on a real sample
        frame_valid = torch.arange(log_spec.shape[-1], device=wave.device) < n_valid[:, None]
        peak = log_spec.masked_fill(~frame_valid[:, None, :], float("-inf")).amax(dim=(1, 2), keepdim=True)
        log_spec = torch.maximum(log_spec, peak - 8.0)
        return (log_spec + 4.0) / 4.0, frame_valid


class WhisperConvTokenizer(nn.Module):
    """Whisper's audio front end: log-mel → ``conv1`` (k3) → GELU → ``conv2`` (k3, stride 2) → GELU →
    + fixed sinusoidal positions (``pos_embed``, a buffer). One token per 20 ms.

    Args: ``d_model``, ``n_mels`` (80 for Whisper v1/v2), ``n_ctx`` (positions: 1500 = 30 s).
    ``forward(wave (B, S) float at 16 kHz, valid (B, S) bool | None) → Tokens`` (positions ``(B, N, 1)``).
    ``pad_to`` (samples, default None): every clip is zeroed past its end and padded (or cut) to this
    length, all of it read as signal — Whisper's ``pad_or_trim`` to 30 s, the input its weights were
    trained on. Raises ``ValueError`` beyond ``n_ctx`` tokens.
    """

    modality = "audio"
    num_prefix_tokens = 0
    sample_rate = 16_000

    def __init__(
        self, d_model: int, n_mels: int = 80, n_ctx: int = 1500, spec_augment: SpecAugment | None = None
    ):
        super().__init__()
        self.mel, self.spec_augment, self.n_ctx = WhisperLogMel(n_mels), spec_augment or SpecAugment(), n_ctx
        self.conv1 = nn.Conv1d(n_mels, d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)
        self.register_buffer("pos_embed", whisper_sinusoids(n_ctx, d_model))
        self.pad_to: int | None = None

    def example_input(self, batch_size: int = 1) -> Tensor:
        return torch.zeros(batch_size, 30 * self.sample_rate)

    def forward(self, wave: Tensor, valid: Tensor | None = None) -> Tokens:
        if self.pad_to is not None:  # Whisper's pad_or_trim: a fixed window of zeros after the clip
            wave = wave if valid is None else wave * valid
            wave, valid = F.pad(wave[:, : self.pad_to], (0, max(0, self.pad_to - wave.shape[1]))), None
        mel, frame_valid = self.mel(wave, valid)  # (B, F, T)
        mel = self.spec_augment(mel) * frame_valid[:, None, :]  # frames past the clip read as zeros
        x = F.gelu(self.conv1(mel.to(self.conv1.weight.dtype))) * frame_valid[:, None, :]
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # (B, N, D), N = ceil(T / 2)
        N = x.shape[1]
        if N > self.n_ctx:
            raise ValueError(f"{N} audio tokens exceed Whisper's {self.n_ctx} positions (30 s)")
        tok_valid = torch.arange(N, device=x.device) * 2 < frame_valid.sum(1, keepdim=True)
        return Tokens.from_embeddings(
            x + self.pos_embed[:N].to(x.dtype), MODALITY_IDS["audio"], valid=tok_valid
        )
