"""Tokenizer kinds — each reads one modality and returns ``Tokens`` (``mmformer.tokenizers``):
``vit_patch`` (images), ``ast`` and ``whisper_conv`` (audio), ``dit`` (noisy images + timestep + class,
for diffusion), ``bpe`` (text) and ``pretrained`` (the embeddings / stem of real pretrained weights).
Each config declares its ``modality``; the data side of an audio tokenizer is ``audio_preprocess``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from omegaconf import MISSING

from ..errors import RecipeError, positive, probability
from ..models.pretrained import FAMILY_MODALITY, Pretrained, pretrained_family
from ..models.pretrained.timm_vit import LoadReport, adapt_tokenizer
from ..registry import register
from ..tokenizers import ViTPatchTokenizer
from ..tokenizers.audio import (
    ASTPatchTokenizer,
    AudioPreprocess,
    LogMel,
    SpecAugment,
    WhisperConvTokenizer,
    ast_grid,
)
from ..tokenizers.diffusion import DiTTokenizer
from ..tokenizers.text import TextEmbedding
from .backbones import freeze, require_position_biases
from .context import BuildContext


@dataclass
class ViTPatchConfig:
    """``model.tokenizers.<name>`` of kind ``vit_patch`` (``mmformer.tokenizers.ViTPatchTokenizer``)."""

    modality: ClassVar[str] = "image"
    kind: str = "vit_patch"
    image_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    class_token: bool = True
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])

    def __post_init__(self) -> None:
        positive(self, "image_size", "patch_size")
        if self.in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 (grayscale) or 3 (RGB), got {self.in_chans}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}")
        if len(self.mean) != self.in_chans or len(self.std) != self.in_chans:
            raise ValueError(f"mean and std need in_chans={self.in_chans} values each")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def check(self, recipe, where: str) -> None:
        """Refuses an AFT kernel with position biases for fewer tokens than the patches (and class token)."""
        cls = " and its class token" if self.class_token else ""
        why = f"'{where}' ({self.image_size}-pixel images in {self.patch_size}-pixel patches{cls})"
        require_position_biases(recipe, where.rsplit(".", 1)[-1], self.num_patches + self.class_token, why)


@dataclass
class AudioAugmentation:
    """The training augmentation every audio tokenizer's data side takes (``tokenizers.audio.AudioPreprocess``
    and ``SpecAugment``; Park et al. 2019). A kind declares ``kind`` again to name itself."""

    kind: str = MISSING
    random_crop: bool = False  # training clips longer than max_seconds: random window instead of the start
    freq_mask: int = 0  # SpecAugment: widest frequency mask in mel bins (training only; 0 = off)
    time_mask: int = 0  # SpecAugment: widest time mask in frames
    gain_db: float = 0.0  # training: random gain in ±gain_db dB
    shift_seconds: float = 0.0  # training: 0 to shift_seconds of leading silence
    noise_snr_db: Optional[float] = None  # training: white noise at a random SNR in [noise_snr_db, 40] dB


@dataclass
class ASTConfig(AudioAugmentation):
    """``model.tokenizers.<name>`` of kind ``ast``: waveform → log-mel → 2-D (frequency × time) patches
    (``mmformer.tokenizers.audio.ASTPatchTokenizer``); the data side resamples to ``sample_rate`` and
    crops to ``max_seconds``."""

    modality: ClassVar[str] = "audio"
    kind: str = "ast"
    sample_rate: int = 16_000  # Hz
    n_fft: int = 400  # samples (25 ms at 16 kHz)
    hop_length: int = 160  # samples (10 ms)
    n_mels: int = 80
    f_min: float = 0.0  # Hz
    f_max: Optional[float] = None  # Hz; None = Nyquist
    patch_size: list[int] = field(default_factory=lambda: [16, 16])  # (mel bins, frames)
    patch_stride: list[int] = field(default_factory=lambda: [16, 16])  # < patch_size: overlapping patches
    max_seconds: float = 10.0
    normalize: str = "fixed"  # fixed: (log10 - mean) / std | utterance: each clip's own per-bin mean/std

    def __post_init__(self) -> None:
        positive(self, "sample_rate", "n_fft", "hop_length", "n_mels", "max_seconds")
        for name in ("patch_size", "patch_stride"):
            v = getattr(self, name)
            if len(v) != 2 or min(v) < 1:
                raise ValueError(f"{name} must be two positive ints (mel bins, frames), got {list(v)}")
        if self.patch_size[0] > self.n_mels:
            raise ValueError(f"patch_size[0]={self.patch_size[0]} exceeds n_mels={self.n_mels}")
        if self.f_max is not None and self.f_max > self.sample_rate / 2:
            raise ValueError(f"f_max={self.f_max} is above the Nyquist frequency {self.sample_rate / 2}")
        if self.normalize not in ("fixed", "utterance"):
            raise ValueError(f"normalize={self.normalize!r}; choose fixed or utterance")

    def check(self, recipe, where: str) -> None:
        """Refuses an AFT kernel with position biases for fewer tokens than the longest clip's patches."""
        n_freq, n_time = ast_grid(self.n_mels, self.patch_size, self.patch_stride, self.max_frames)
        why = f"'{where}' ({self.max_seconds:g}-second clips: {n_freq} × {n_time} patches)"
        require_position_biases(recipe, where.rsplit(".", 1)[-1], n_freq * n_time, why)

    @property
    def max_frames(self) -> int:
        return int(round(self.max_seconds * self.sample_rate)) // self.hop_length + 1


@dataclass
class WhisperConvConfig(AudioAugmentation):
    """``model.tokenizers.<name>`` of kind ``whisper_conv``: a from-scratch Whisper front end — log-mel as
    Whisper computes it (16 kHz, 25 ms windows, 10 ms hop) → two 1-D convolutions (the second of stride 2)
    → sinusoidal positions, one token per 20 ms (``mmformer.tokenizers.audio.WhisperConvTokenizer``;
    Radford et al. 2022, §2.2). The pretrained stem is ``kind: pretrained, source: whisper-tiny.en``."""

    modality: ClassVar[str] = "audio"
    kind: str = "whisper_conv"
    n_mels: int = 80
    max_seconds: float = 30.0  # longer clips are cut (the sinusoids cover 30 s)

    @property
    def sample_rate(self) -> int:
        return 16_000  # Whisper's log-mel is defined at 16 kHz

    @property
    def n_ctx(self) -> int:
        """Tokens of the longest clip: 100 frames per second, then a stride-2 convolution."""
        return int(round(self.max_seconds * 100)) // 2 + 1

    def check(self, recipe, where: str) -> None:
        """Refuses an AFT kernel with position biases for fewer tokens than the longest clip gives."""
        why = f"'{where}' ({self.max_seconds:g}-second clips, one token per 20 ms)"
        require_position_biases(recipe, where.rsplit(".", 1)[-1], self.n_ctx, why)

    def __post_init__(self) -> None:
        positive(self, "n_mels", "max_seconds")
        if self.max_seconds > 30.0:
            raise ValueError(f"max_seconds={self.max_seconds}: the Whisper stem has 30 s of positions")


@dataclass
class DiTTokenizerConfig:
    """``model.tokenizers.<name>`` of kind ``dit``: a noisy image, its timestep and its class → patch
    tokens with 2-D sin-cos positions + the adaLN conditioning vector (``mmformer.tokenizers.diffusion``;
    DiT, Peebles & Xie 2023). The backbone needs ``block: adaln``."""

    kind: str = "dit"
    modality: str = "image"  # reads the batch's images
    image_size: int = 28
    patch_size: int = 4
    in_chans: int = 1
    num_classes: Optional[int] = None  # class-conditional (with a null class); None = unconditional
    text_conditional: bool = False  # conditioned on a pooled caption (the task's caption_tokenizer)
    class_dropout: float = 0.1  # classifier-free guidance: P(label / caption → null) in training

    def __post_init__(self) -> None:
        positive(self, "image_size", "patch_size", "in_chans", "num_classes")
        probability(self, "class_dropout")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}")

    def check(self, recipe, where: str) -> None:
        """Refuses an AFT kernel with position biases for fewer tokens than the noisy image's patches."""
        why = f"'{where}' ({self.image_size}-pixel images in {self.patch_size}-pixel patches)"
        require_position_biases(
            recipe, where.rsplit(".", 1)[-1], (self.image_size // self.patch_size) ** 2, why
        )


@dataclass
class BPEConfig:
    """``model.tokenizers.<name>`` of kind ``bpe``: byte-level BPE text (``TextTokenizer`` + ``TextEmbedding``)."""

    modality: ClassVar[str] = "text"
    kind: str = "bpe"
    path: Optional[str] = None  # a tokenizer.json; default: train one on the task's training documents
    vocab_size: int = 8192  # when training
    max_len: Optional[int] = None  # learned absolute positions up to this length (GPT-2); None for RoPE

    def __post_init__(self) -> None:
        positive(self, "vocab_size", "max_len")


@dataclass
class PretrainedTokenizerConfig(AudioAugmentation):
    """``model.tokenizers.<name>`` of kind ``pretrained``: the tokenizer and embeddings of pretrained
    weights — text (vocabulary, special tokens, chat template) or audio (Whisper's log-mel and conv
    stem; the augmentation fields apply to audio sources); usually the backbone's ``source``."""

    kind: str = "pretrained"
    source: str = MISSING
    # an encoder–decoder source (Whisper): encoder (default: the audio stem) | decoder (its text
    # tokenizer, prompt and embeddings; the recipe then loads the whole model)
    part: Optional[str] = None
    freeze: bool = False  # keep the embeddings / stem (and a head tied to them) fixed
    image_size: Optional[int] = None  # image (timm ViT): position embeddings resampled to this size
    in_chans: Optional[int] = None  # image (timm ViT): patch embedding adapted to 1 (gray) or 3 channels
    max_seconds: float = 30.0  # audio: longer clips are cut (Whisper has 30 s of positions)
    # audio: zero-pad every clip to max_seconds, all of it read as signal (Whisper's pad_or_trim: the
    # pretrained model was trained on 30 s windows and transcribes short unpadded clips worse)
    pad_to_max: bool = False

    @property
    def sample_rate(self) -> int:
        return 16_000  # Whisper's

    def __post_init__(self) -> None:
        positive(self, "max_seconds", "image_size")
        if self.part not in (None, "encoder", "decoder"):
            raise ValueError(f"part={self.part!r}; choose encoder or decoder (of an encoder–decoder source)")
        if self.in_chans not in (None, 1, 3):
            raise ValueError(f"in_chans must be 1 (grayscale) or 3 (RGB), got {self.in_chans}")
        if self.max_seconds > 30.0:
            raise ValueError(f"max_seconds={self.max_seconds}: Whisper's encoder has 30 s of positions")


@register("tokenizer", "vit_patch", ViTPatchConfig)
def build_vit_patch(cfg: ViTPatchConfig, d_model: int, ctx: BuildContext, name: str) -> ViTPatchTokenizer:
    return ViTPatchTokenizer(
        d_model,
        cfg.image_size,
        cfg.patch_size,
        cfg.in_chans,
        cfg.class_token,
        tuple(cfg.mean),
        tuple(cfg.std),
    )


@register("tokenizer", "ast", ASTConfig)
def build_ast(cfg: ASTConfig, d_model: int, ctx: BuildContext, name: str) -> ASTPatchTokenizer:
    mel = LogMel(
        cfg.sample_rate, cfg.n_fft, cfg.hop_length, cfg.n_mels, cfg.f_min, cfg.f_max, normalize=cfg.normalize
    )
    return ASTPatchTokenizer(
        d_model,
        mel,
        tuple(cfg.patch_size),
        tuple(cfg.patch_stride),
        cfg.max_frames,
        SpecAugment(cfg.freq_mask, cfg.time_mask),
    )


@register("tokenizer", "whisper_conv", WhisperConvConfig)
def build_whisper_conv(
    cfg: WhisperConvConfig, d_model: int, ctx: BuildContext, name: str
) -> WhisperConvTokenizer:
    return WhisperConvTokenizer(d_model, cfg.n_mels, cfg.n_ctx, SpecAugment(cfg.freq_mask, cfg.time_mask))


@register("tokenizer", "dit", DiTTokenizerConfig)
def build_dit_tokenizer(cfg: DiTTokenizerConfig, d_model: int, ctx: BuildContext, name: str) -> DiTTokenizer:
    return DiTTokenizer(
        d_model,
        cfg.image_size,
        cfg.patch_size,
        cfg.in_chans,
        cfg.num_classes,
        cfg.class_dropout,
        cfg.text_conditional,
    )


@register("tokenizer", "bpe", BPEConfig)
def build_bpe(cfg: BPEConfig, d_model: int, ctx: BuildContext, name: str) -> TextEmbedding:
    return TextEmbedding(ctx.text_tokenizer(name).vocab_size, d_model, cfg.max_len)


def timm_report(pretrained: Pretrained) -> LoadReport:
    if pretrained.report is None:  # rebuilt from a checkpoint: nothing was read from the source
        pretrained.report = LoadReport(pretrained.source)
    return pretrained.report


def part_tokenizer(pretrained: Pretrained, part: str | None, where: str):
    """The tokenizer of ``part`` of a pretrained source: its only one, or an encoder–decoder's (Whisper:
    ``encoder`` → the audio stem, ``decoder`` → the text embeddings). Raises ``RecipeError`` for a
    ``part`` of a source that has no parts."""
    tokenizers = pretrained.model.tokenizers
    if pretrained.family != "whisper":
        if part is not None:
            raise RecipeError(
                f"'{where}.part' applies to encoder–decoder sources (Whisper), not {pretrained.source}"
            )
        (tokenizer,) = tokenizers.values()
        return tokenizer
    return tokenizers["text" if part == "decoder" else "audio"]


@register("tokenizer", "pretrained", PretrainedTokenizerConfig)
def build_pretrained_tokenizer(cfg: PretrainedTokenizerConfig, d_model: int, ctx: BuildContext, name: str):
    pretrained = ctx.pretrained(cfg.source)
    tokenizer = part_tokenizer(pretrained, cfg.part, f"model.tokenizers.{name}")
    if pretrained.family == "timm_vit":
        try:
            tokenizer, _ = adapt_tokenizer(
                tokenizer, pretrained.config, timm_report(pretrained), cfg.image_size, cfg.in_chans
            )
        except ValueError as e:
            raise RecipeError(f"image_size / in_chans of the {cfg.source} tokenizer: {e}") from None
    elif cfg.image_size is not None or cfg.in_chans is not None:
        raise RecipeError(f"image_size / in_chans apply to image encoders; {cfg.source} is not one")
    if hasattr(tokenizer, "embed"):
        width = tokenizer.embed.embedding_dim
    elif hasattr(tokenizer, "patch_embed"):
        width = tokenizer.patch_embed.proj.out_channels
    else:
        width = tokenizer.conv2.out_channels
    if width != d_model:
        raise RecipeError(f"the {cfg.source} tokenizer is {width} wide but the backbone is {d_model}")
    if cfg.freq_mask or cfg.time_mask:
        if not hasattr(tokenizer, "spec_augment"):
            raise RecipeError(f"freq_mask / time_mask apply to audio; {cfg.source} is a text model")
        tokenizer.spec_augment = SpecAugment(cfg.freq_mask, cfg.time_mask)
    if cfg.pad_to_max:
        if not hasattr(tokenizer, "pad_to"):
            raise RecipeError(
                f"'model.tokenizers.{name}.pad_to_max' applies to audio; this part of {cfg.source} is not"
            )
        tokenizer.pad_to = int(round(cfg.max_seconds * tokenizer.sample_rate))
    if cfg.freeze:
        freeze(tokenizer)
    return tokenizer


def audio_preprocess(tok_cfg) -> tuple[AudioPreprocess, AudioPreprocess]:
    """(train, val) data sides: augmentation on the training clips only."""
    rate, seconds = tok_cfg.sample_rate, tok_cfg.max_seconds
    train = AudioPreprocess(
        rate, seconds, tok_cfg.random_crop, tok_cfg.gain_db, tok_cfg.shift_seconds, tok_cfg.noise_snr_db
    )
    return train, AudioPreprocess(rate, seconds)


def modality_at_load(cfg) -> str | None:
    """A tokenizer config's modality as far as the recipe alone tells: a pretrained source that cannot
    be resolved here (a checkpoint's, on another machine) gives None (its rules are checked at build)."""
    if cfg.kind != "pretrained":
        return getattr(cfg, "modality", "image")  # a user's kind that declares none reads images
    if getattr(cfg, "part", None) == "decoder":  # an encoder–decoder's text side
        return "text"
    try:
        return FAMILY_MODALITY[pretrained_family(cfg.source)]
    except (FileNotFoundError, ValueError):
        return None
