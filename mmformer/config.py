"""Typed recipe schema and its loading: defaults ← recipe YAML ← ``key=value`` overrides.

A recipe is YAML read by OmegaConf's own loader (``1e-3`` is a float, ``null`` is None) and merged
into the dataclasses below, so unknown keys and wrong types fail with the full key, a did-you-mean
and the expected type. Components (tokenizers, backbone, heads, tasks, datasets) are picked by
``kind`` from ``mmformer.registry``: OmegaConf cannot switch between dataclass variants on merge, so
``kind`` is read first and the node is then merged into that kind's dataclass. Derived values are
computed and checked in ``__post_init__``, never written in YAML.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .registry import lookup


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the key and what was expected."""


# --------------------------------------------------------------------------- components
@dataclass
class BackboneConfig:
    """``model.backbone``: the shared transformer (``mmformer.models.Backbone``)."""

    kind: str = "transformer"
    preset: Optional[str] = None  # debug | tiny | small | base | large: fills unset sizes
    d_model: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None  # grouped-query attention (1 = multi-query)
    mlp_ratio: float = 4.0
    mlp_hidden: Optional[int] = None  # overrides mlp_ratio · d_model
    block: str = "pre"  # pre | post (BERT) | cross (decoder with cross-attention) | adaln (DiT) | conformer
    conv_kernel: int = 31  # conformer: depthwise convolution width, in tokens (odd)
    d_context: Optional[int] = None  # cross: width of the encoder output it attends to (default d_model)
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-6
    act: str = "gelu"  # gelu | gelu_tanh | relu | swiglu
    qkv_bias: bool = True
    proj_bias: bool = True  # attention output bias (Llama: false)
    mlp_bias: bool = True
    qk_norm: bool = False
    drop: float = 0.0
    attn_drop: float = 0.0
    drop_path: float = 0.0  # stochastic depth at the last block (linear over depth)
    layer_scale: Optional[float] = None  # initial LayerScale value, e.g. 1e-5
    causal: bool = False
    # modalities whose tokens attend to each other both ways in a causal backbone (Transfusion): a
    # causal LM and image / audio tasks sharing one backbone, e.g. [image, audio]
    bidirectional: list[str] = field(default_factory=list)
    positions: str = "none"  # none (tokenizers add absolute ones) | rope | alibi | t5 | toeplitz
    rel_buckets: int = 32  # t5: relative-position buckets
    rel_max_distance: int = 128  # t5 / toeplitz: offsets beyond this share the last bucket
    rope_base: float = 10_000.0
    rope_axes: int = 1  # 2 = multimodal RoPE over (row, column) of patch grids (Qwen2-VL sections)
    window: Optional[int] = None  # sliding-window attention, in tokens
    # BigBird block-sparse attention: blocks of bigbird_block tokens read a band of bigbird_window
    # blocks each side, bigbird_global leading blocks (which read everything) and bigbird_random others
    bigbird_block: Optional[int] = None
    bigbird_window: int = 1
    bigbird_global: int = 1
    bigbird_random: int = 1
    d_cond: Optional[int] = None  # adaln: conditioning width (default d_model)
    final_norm: bool = True
    attn_kernel: str = "auto"  # auto | sdpa | flex | eager | performer (random-feature linear attention)
    performer_features: int = 256  # performer: random features per head
    sdpa_backend: str = "auto"  # auto | flash | efficient | cudnn | math (CUDA only)

    def __post_init__(self) -> None:
        from .models.backbone import BLOCKS, POSITIONS
        from .models.presets import preset
        from .nn.attention import KERNELS, SDPA_BACKENDS
        from .nn.mlp import ACTIVATIONS
        from .nn.norms import NORMS

        if self.preset is not None:
            for k, v in preset(self.preset).items():
                if getattr(self, k) is None:
                    setattr(self, k, v)
        for k in ("d_model", "n_layers", "n_heads"):
            if getattr(self, k) is None:
                raise ValueError(f"{k} is required (or set preset: debug|tiny|small|base|large)")
        _positive(self, "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_ratio")
        _probability(self, "drop", "attn_drop", "drop_path")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.attn_kernel not in KERNELS:
            raise ValueError(f"attn_kernel={self.attn_kernel!r}; choose from {KERNELS}")
        for name, allowed in (
            ("block", BLOCKS),
            ("norm", NORMS),
            ("act", ACTIVATIONS),
            ("positions", POSITIONS),
            ("sdpa_backend", SDPA_BACKENDS),
        ):
            if getattr(self, name) not in allowed:
                close = difflib.get_close_matches(str(getattr(self, name)), allowed, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"{name}={getattr(self, name)!r}.{hint} Choose from {', '.join(allowed)}")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        _positive(self, "window", "mlp_hidden", "d_cond", "rope_axes")
        from .nn.tokens import MODALITY_IDS

        for name in self.bidirectional:
            if name not in MODALITY_IDS or name == "text":
                allowed = [m for m in MODALITY_IDS if m != "text"]
                raise ValueError(f"bidirectional: {name!r} is not a modality; choose from {allowed}")
        if self.bidirectional and not self.causal:
            raise ValueError("bidirectional lists modalities exempt from a causal mask: set causal: true")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class ViTPatchConfig:
    """``model.tokenizers.<name>`` of kind ``vit_patch`` (``mmformer.tokenizers.ViTPatchTokenizer``)."""

    kind: str = "vit_patch"
    image_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    class_token: bool = True
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])

    def __post_init__(self) -> None:
        _positive(self, "image_size", "patch_size")
        if self.in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 (grayscale) or 3 (RGB), got {self.in_chans}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}")
        if len(self.mean) != self.in_chans or len(self.std) != self.in_chans:
            raise ValueError(f"mean and std need in_chans={self.in_chans} values each")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass
class ClassifierHeadConfig:
    """``model.heads.<name>`` of kind ``classifier`` (``mmformer.models.ClassifierHead``)."""

    kind: str = "classifier"
    num_classes: int = MISSING
    pool: str = "cls"  # cls | mean
    fc_norm: bool = False
    drop: float = 0.0

    def __post_init__(self) -> None:
        if self.pool not in ("cls", "mean"):
            raise ValueError(f"pool={self.pool!r}; choose 'cls' or 'mean'")
        _positive(self, "num_classes")
        _probability(self, "drop")


@dataclass
class ClassificationTaskConfig:
    """``tasks.<name>`` of kind ``classification``: cross-entropy on a head's logits, accuracy."""

    kind: str = "classification"
    weight: float = 1.0
    tokenizer: str = MISSING  # a model.tokenizers entry
    head: str = MISSING  # a model.heads entry
    data: dict[str, Any] = field(default_factory=dict)
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        _probability(self, "label_smoothing")
        if self.weight < 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")


@dataclass
class ImageFolderDataConfig:
    """``tasks.<name>.data`` of kind ``image_folder``: ``root/<split>/<class>/*.png|jpg|…``.

    ``root`` is a path, or a bundled dataset name (``mmformer data list``) under the data root.
    """

    kind: str = "image_folder"
    root: str = MISSING
    train_split: str = "train"
    val_split: str = "val"
    batch_size: int = 64
    val_batch_size: Optional[int] = None  # default: batch_size
    num_workers: int = 2
    cache: bool = False  # keep decoded images in memory (small datasets)
    crop_padding: int = 0  # training augmentation: RandomCrop(image_size, padding)
    hflip: bool = False  # training augmentation: horizontal flips
    drop_last: bool = True

    def __post_init__(self) -> None:
        _positive(self, "batch_size", "val_batch_size")
        if self.num_workers < 0 or self.crop_padding < 0:
            raise ValueError("num_workers and crop_padding must be >= 0")


@dataclass
class ShardsDataConfig:
    """``tasks.<name>.data`` of kind ``shards``: WebDataset tar shards written by ``mmformer data shard``,
    read per rank and per data-loader worker through a shuffling buffer (``mmformer.data.shards``):
    images or audio with class labels (classification); documents (causal_lm, masked_lm: one padded
    document per sample, or with ``pack`` full windows as ``data.kind: text``, ``packed_shards``);
    image–caption or audio–transcript pairs (contrastive, prefix_lm, seq2seq: the items and batches of
    ``data.kind: image_caption`` / ``audio_caption``, ``caption_shards``; the caption tokenizer needs a
    ``path``). ``val_split`` is the split's name in the index: ``test`` for shards of ``asterisk-speech``."""

    kind: str = "shards"
    root: str = MISSING
    train_split: str = "train"
    val_split: str = "val"
    batch_size: int = 64
    val_batch_size: Optional[int] = None
    num_workers: int = 2
    shuffle_buffer: int = 1000  # samples held for shuffling, per worker
    seq_len: int = 256  # text: tokens per document (truncated, padded) or per packed window
    pack: bool = False  # text: pack documents into full seq_len windows with document ids (training)
    max_len: int = 32  # captions: tokens, BOS/EOS included, longer ones cut (audio_caption's default is 48)
    label_key: Optional[str] = None  # image captions: the row field naming each item's zero-shot class,
    # with its prompts in <root>/<label_key>.json (copied there by `mmformer data shard`)
    crop_padding: int = 0  # image classification training augmentation
    hflip: bool = False

    def __post_init__(self) -> None:
        _positive(self, "batch_size", "val_batch_size", "shuffle_buffer", "seq_len", "max_len")
        if self.num_workers < 0 or self.crop_padding < 0:
            raise ValueError("num_workers and crop_padding must be >= 0")


@dataclass
class CIFAR10DataConfig:
    """``tasks.<name>.data`` of kind ``cifar10``: CIFAR-10's python format (torchvision)."""

    kind: str = "cifar10"
    root: str = "cifar10"
    download: bool = False  # fetch from the official URL (needs internet)
    batch_size: int = 128
    val_batch_size: Optional[int] = None
    num_workers: int = 2
    crop_padding: int = 4
    hflip: bool = True
    drop_last: bool = True


def _positive(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def _probability(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")


@dataclass
class BPEConfig:
    """``model.tokenizers.<name>`` of kind ``bpe``: byte-level BPE text (``TextTokenizer`` + ``TextEmbedding``)."""

    kind: str = "bpe"
    path: Optional[str] = None  # a tokenizer.json; default: train one on the task's training documents
    vocab_size: int = 8192  # when training
    max_len: Optional[int] = None  # learned absolute positions up to this length (GPT-2); None for RoPE

    def __post_init__(self) -> None:
        _positive(self, "vocab_size", "max_len")


@dataclass
class LMHeadConfig:
    """``model.heads.<name>`` of kind ``lm``: next-token logits over the text tokenizer's vocabulary."""

    kind: str = "lm"
    tie_weights: bool = True  # share the token-embedding matrix


@dataclass
class CausalLMTaskConfig:
    """``tasks.<name>`` of kind ``causal_lm``: next-token prediction, perplexity."""

    kind: str = "causal_lm"
    weight: float = 1.0
    tokenizer: str = MISSING
    head: str = MISSING
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class MaskedLMTaskConfig:
    """``tasks.<name>`` of kind ``masked_lm``: BERT's masked language modelling (``mask_prob`` of the real
    tokens chosen, 80/10/10 [MASK] / random / kept, loss on the chosen ones), on a bidirectional backbone;
    validation: masked-token accuracy, loss, perplexity (``mmformer.tasks.masked_lm``)."""

    kind: str = "masked_lm"
    weight: float = 1.0
    tokenizer: str = MISSING
    head: str = MISSING  # an mlm (or lm) head
    mask_prob: float = 0.15
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {self.mask_prob}")


@dataclass
class MLMHeadConfig:
    """``model.heads.<name>`` of kind ``mlm``: BERT's masked-LM head (dense, GELU, LayerNorm, decoder over
    the vocabulary with a bias; ``mmformer.models.heads.MLMHead``)."""

    kind: str = "mlm"
    tie_weights: bool = True  # the decoder shares the token-embedding matrix


@dataclass
class TextDataConfig:
    """``tasks.<name>.data`` of kind ``text``: a corpus (file or folder, blank-line separated documents),
    a path or a bundled name (``kjv``); tokenized once into a memory-mapped cache."""

    kind: str = "text"
    root: str = MISSING
    seq_len: int = 256
    pack: bool = True  # pack documents into full windows (with document ids) instead of padding each
    val_fraction: float = 0.05  # documents held out, seeded by the recipe seed
    batch_size: int = 32
    val_batch_size: Optional[int] = None
    num_workers: int = 0
    drop_last: bool = True
    # pack: false — batches of documents of similar length, trimmed to their longest (less padding)
    bucket_by_length: bool = False

    def __post_init__(self) -> None:
        if self.bucket_by_length and self.pack:
            raise ValueError("bucket_by_length needs pack: false (packed windows all have seq_len tokens)")
        _positive(self, "seq_len", "batch_size", "val_batch_size")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")


@dataclass
class ASTConfig:
    """``model.tokenizers.<name>`` of kind ``ast``: waveform → log-mel → 2-D (frequency × time) patches
    (``mmformer.tokenizers.audio.ASTPatchTokenizer``); the data side resamples to ``sample_rate`` and
    crops to ``max_seconds``."""

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
    freq_mask: int = 0  # SpecAugment: widest frequency mask in mel bins (training only; 0 = off)
    time_mask: int = 0  # SpecAugment: widest time mask in frames
    random_crop: bool = False  # training clips longer than max_seconds: random window instead of the start
    gain_db: float = 0.0  # training: random gain in ±gain_db dB
    shift_seconds: float = 0.0  # training: 0 to shift_seconds of leading silence
    noise_snr_db: Optional[float] = None  # training: white noise at a random SNR in [noise_snr_db, 40] dB

    def __post_init__(self) -> None:
        _positive(self, "sample_rate", "n_fft", "hop_length", "n_mels", "max_seconds")
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

    @property
    def max_frames(self) -> int:
        return int(round(self.max_seconds * self.sample_rate)) // self.hop_length + 1


@dataclass
class WhisperConvConfig:
    """``model.tokenizers.<name>`` of kind ``whisper_conv``: a from-scratch Whisper front end — log-mel as
    Whisper computes it (16 kHz, 25 ms windows, 10 ms hop) → two 1-D convolutions (the second of stride 2)
    → sinusoidal positions, one token per 20 ms (``mmformer.tokenizers.audio.WhisperConvTokenizer``;
    Radford et al. 2022, §2.2). The pretrained stem is ``kind: pretrained, source: whisper-tiny.en``."""

    kind: str = "whisper_conv"
    n_mels: int = 80
    max_seconds: float = 30.0  # longer clips are cut (the sinusoids cover 30 s)
    random_crop: bool = False  # training clips longer than max_seconds: random window instead of the start
    freq_mask: int = 0  # SpecAugment: widest frequency mask in mel bins (training only; 0 = off)
    time_mask: int = 0  # SpecAugment: widest time mask in frames
    gain_db: float = 0.0  # training: random gain in ±gain_db dB
    shift_seconds: float = 0.0  # training: 0 to shift_seconds of leading silence
    noise_snr_db: Optional[float] = None  # training: white noise at a random SNR in [noise_snr_db, 40] dB

    @property
    def sample_rate(self) -> int:
        return 16_000  # Whisper's log-mel is defined at 16 kHz

    def __post_init__(self) -> None:
        _positive(self, "n_mels", "max_seconds")
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
        _positive(self, "image_size", "patch_size", "in_chans", "num_classes")
        _probability(self, "class_dropout")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}")


@dataclass
class DiTHeadConfig:
    """``model.heads.<name>`` of kind ``dit``: DiT's adaLN final layer + unpatchify back to an image; with
    ``learn_sigma`` it also predicts the variance (twice the channels; Nichol & Dhariwal 2021)."""

    kind: str = "dit"
    learn_sigma: bool = False


@dataclass
class DiffusionTaskConfig:
    """``tasks.<name>`` of kind ``diffusion``: train a DiT to denoise the task's images.

    ``objective: gaussian`` — DDPM (Ho et al. 2020) with a ``linear`` or ``cosine`` β schedule over
    ``num_timesteps``, ``eps`` or ``v`` prediction, optional min-SNR-γ weighting; sampled with DDIM or
    DDPM. ``objective: flow`` — rectified flow (Liu et al. 2022), t ``uniform`` or ``logit_normal``;
    sampled with Euler or Heun."""

    kind: str = "diffusion"
    weight: float = 1.0
    tokenizer: str = MISSING  # a model.tokenizers entry of kind dit
    head: str = MISSING  # a model.heads entry of kind dit
    data: dict[str, Any] = field(default_factory=dict)
    caption_tokenizer: Optional[str] = None  # text-conditional: the text tokenizer that reads captions
    objective: str = "gaussian"  # gaussian | flow
    num_timesteps: int = 1000
    beta_schedule: str = "linear"  # linear | cosine
    beta_start: float = 1e-4
    beta_end: float = 0.02
    prediction: str = "eps"  # eps | v
    min_snr_gamma: Optional[float] = None  # e.g. 5.0
    t_sampling: str = "uniform"  # flow: uniform | logit_normal
    # the sample grid logged after each validation
    sample_cfg_scale: float = 4.0
    sample_steps: int = 50
    samples_per_class: int = 8

    def __post_init__(self) -> None:
        choices = {
            "objective": ("gaussian", "flow"),
            "beta_schedule": ("linear", "cosine"),
            "prediction": ("eps", "v"),
            "t_sampling": ("uniform", "logit_normal"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose {' | '.join(allowed)}")
        _positive(
            self, "num_timesteps", "sample_steps", "samples_per_class", "sample_cfg_scale", "min_snr_gamma"
        )
        if not 0 < self.beta_start < self.beta_end < 1:
            raise ValueError(f"need 0 < beta_start < beta_end < 1, got {self.beta_start}, {self.beta_end}")
        if self.weight < 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")


@dataclass
class AudioFolderDataConfig:
    """``tasks.<name>.data`` of kind ``audio_folder``: ``root/<split>/<class>/<clip>`` (wav, flac, ogg, …);
    ``root`` is a path or a bundled name (``spoken-words``)."""

    kind: str = "audio_folder"
    root: str = MISSING
    train_split: str = "train"
    val_split: str = "val"
    batch_size: int = 32
    val_batch_size: Optional[int] = None
    num_workers: int = 0
    drop_last: bool = True
    bucket_by_length: bool = False  # batches of clips of similar duration (less padding)

    def __post_init__(self) -> None:
        _positive(self, "batch_size", "val_batch_size")


@dataclass
class AudioManifestDataConfig(AudioFolderDataConfig):
    """``tasks.<name>.data`` of kind ``audio_manifest``: ``root/<split>.jsonl`` with one
    ``{"audio": path, "label": …, "text": …}`` per line (``asterisk-en``)."""

    kind: str = "audio_manifest"
    label_key: str = "label"  # the manifest field that is the class (asterisk-en also has "group")


@dataclass
class PretrainedBackboneConfig:
    """``model.backbone`` of kind ``pretrained``: the backbone of real pretrained weights
    (``mmformer.models.pretrained``: a known name, a ``.gguf`` file or an HF Llama / BERT directory)."""

    kind: str = "pretrained"
    source: str = MISSING  # smollm2-135m-instruct | all-minilm-l6-v2 | PATH
    freeze_layers: int = 0  # freeze the first k blocks; all of them: the final norm too (the tokenizer's
    # `freeze` freezes the embeddings)

    def __post_init__(self) -> None:
        if self.freeze_layers < 0:
            raise ValueError(f"freeze_layers must be >= 0, got {self.freeze_layers}")


@dataclass
class PretrainedTokenizerConfig:
    """``model.tokenizers.<name>`` of kind ``pretrained``: the tokenizer and embeddings of pretrained
    weights — text (vocabulary, special tokens, chat template) or audio (Whisper's log-mel and conv
    stem); usually the backbone's ``source``."""

    kind: str = "pretrained"
    source: str = MISSING
    freeze: bool = False  # keep the embeddings / stem (and a head tied to them) fixed
    image_size: Optional[int] = None  # image (timm ViT): position embeddings resampled to this size
    in_chans: Optional[int] = None  # image (timm ViT): patch embedding adapted to 1 (gray) or 3 channels
    max_seconds: float = 30.0  # audio: longer clips are cut (Whisper has 30 s of positions)
    random_crop: bool = False  # audio: training clips longer than max_seconds get a random window
    freq_mask: int = 0  # audio: SpecAugment frequency mask width in mel bins (training only)
    time_mask: int = 0  # audio: SpecAugment time mask width in frames
    gain_db: float = 0.0  # audio, training: random gain in ±gain_db dB
    shift_seconds: float = 0.0  # audio, training: 0 to shift_seconds of leading silence
    noise_snr_db: Optional[float] = (
        None  # audio, training: white noise at a random SNR in [noise_snr_db, 40] dB
    )

    @property
    def sample_rate(self) -> int:
        return 16_000  # Whisper's

    def __post_init__(self) -> None:
        _positive(self, "max_seconds", "image_size")
        if self.in_chans not in (None, 1, 3):
            raise ValueError(f"in_chans must be 1 (grayscale) or 3 (RGB), got {self.in_chans}")
        if self.max_seconds > 30.0:
            raise ValueError(f"max_seconds={self.max_seconds}: Whisper's encoder has 30 s of positions")


@dataclass
class PretrainedHeadConfig:
    """``model.heads.<name>`` of kind ``pretrained``: the head the weights carry (``lm`` of a Llama,
    ``embedding`` — mean pool + L2 — of a sentence encoder, the classifier of a timm ViT, replaced by a
    new zero-initialised one when ``num_classes`` differs from the checkpoint's)."""

    kind: str = "pretrained"
    source: str = MISSING
    num_classes: Optional[int] = None  # timm ViT: a new classifier for this many classes

    def __post_init__(self) -> None:
        _positive(self, "num_classes")


@dataclass
class LoRAConfig:
    """``model.lora``: low-rank adapters on the (pretrained) backbone's linear layers; every part of kind
    ``pretrained`` is frozen, the adapters and parts built new (e.g. a classifier head) train
    (Hu et al. 2021)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])

    def __post_init__(self) -> None:
        _positive(self, "rank")
        _probability(self, "dropout")
        allowed = {"qkv", "proj", "fc1", "fc2", "q", "kv"}
        bad = [t for t in self.targets if t not in allowed]
        if bad or not self.targets:
            raise ValueError(f"targets {self.targets} must be a non-empty subset of {sorted(allowed)}")


@dataclass
class TextClassificationDataConfig:
    """``tasks.<name>.data`` of kind ``text_classification``: JSONL manifests ``root/train.jsonl`` and
    ``root/val.jsonl`` of ``{"text": …, "label": …}`` (label a class name); ``root/classes.txt``, when
    present, fixes the class order. ``root`` is a path or a bundled name (``wordnet-supersenses``)."""

    kind: str = "text_classification"
    root: str = MISSING
    max_len: int = 128  # tokens per text, special tokens included; longer texts are cut
    batch_size: int = 32
    val_batch_size: Optional[int] = None
    num_workers: int = 0
    drop_last: bool = True
    limit_train: Optional[int] = None  # use the first N training examples (after a seeded shuffle)

    def __post_init__(self) -> None:
        _positive(self, "max_len", "batch_size", "val_batch_size", "limit_train")


@dataclass
class ImageCaptionDataConfig:
    """``tasks.<name>.data`` of kind ``image_caption``: ``root/<split>.jsonl`` of ``{"image": path,
    "caption": text}`` (paths relative to ``root``); ``root`` is a path or a bundled name (``emoji``).
    The captions are read with the task's ``caption_tokenizer``."""

    kind: str = "image_caption"
    root: str = MISSING
    train_split: str = "train"
    val_split: str = "val"
    max_len: int = 32  # caption tokens, BOS/EOS included; longer captions are cut
    batch_size: int = 64
    val_batch_size: Optional[int] = None
    num_workers: int = 0
    drop_last: bool = True
    cache: bool = True  # keep decoded images in memory
    label_key: Optional[str] = None  # a row field naming each item's class (emoji: group), for zero-shot;
    # the classes and their prompts are read from root/<label_key>.json ({class: [prompt, …]})

    def __post_init__(self) -> None:
        _positive(self, "max_len", "batch_size", "val_batch_size")


@dataclass
class AudioCaptionDataConfig:
    """``tasks.<name>.data`` of kind ``audio_caption``: JSONL manifests ``root/<split>.jsonl`` of
    ``{"audio": path, "text": transcript}``; ``root`` is a path or a bundled name (``asterisk-speech``).
    The transcripts are read with the task's ``caption_tokenizer``."""

    kind: str = "audio_caption"
    root: str = MISSING
    train_split: str = "train"
    val_split: str = "test"
    text_key: str = "text"
    max_len: int = 48  # transcript tokens, BOS/EOS included; longer ones are cut
    batch_size: int = 32
    val_batch_size: Optional[int] = None
    num_workers: int = 0
    drop_last: bool = True

    def __post_init__(self) -> None:
        _positive(self, "max_len", "batch_size", "val_batch_size")


@dataclass
class ProjectionHeadConfig:
    """``model.heads.<name>`` of kind ``projection``: pooled hidden state → shared embedding space
    (``mmformer.models.ProjectionHead``), read by a contrastive task."""

    kind: str = "projection"
    embed_dim: int = MISSING
    pool: str = "cls"  # cls | mean | last (the last real token: a causal text encoder's end of text)
    norm: bool = False  # LayerNorm before the projection

    def __post_init__(self) -> None:
        if self.pool not in ("cls", "mean", "last"):
            raise ValueError(f"pool={self.pool!r}; choose cls, mean or last")
        _positive(self, "embed_dim")


@dataclass
class ContrastiveTaskConfig:
    """``tasks.<name>`` of kind ``contrastive``: CLIP (softmax InfoNCE) or SigLIP (sigmoid) between the
    inputs (``tokenizer`` → ``head``) and their captions (``caption_tokenizer`` → ``caption_head``);
    held-out retrieval recall and zero-shot classification (``mmformer.tasks.contrastive``)."""

    kind: str = "contrastive"
    weight: float = 1.0
    tokenizer: str = MISSING  # image (or audio) tokenizer
    head: str = MISSING  # its projection head
    caption_tokenizer: str = MISSING  # text tokenizer
    caption_head: str = MISSING  # its projection head
    loss: str = "clip"  # clip | siglip
    init_temperature: Optional[float] = None  # default: CLIP 0.07, SigLIP 0.1
    init_bias: float = -10.0  # SigLIP's logit bias
    learn_temperature: bool = True
    gather: bool = True  # score against every rank's pairs (features gathered with gradients)
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.loss not in ("clip", "siglip"):
            raise ValueError(f"loss={self.loss!r}; choose clip or siglip")
        _positive(self, "init_temperature")
        if self.weight < 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")


@dataclass
class ProjectorHeadConfig:
    """``model.heads.<name>`` of kind ``projector``: an encoder tower's tokens → the backbone's width, the
    prefix of a ``prefix_lm`` task that names it as ``projector`` (``mmformer.models.heads.ProjectorHead``,
    LLaVA's two-layer MLP after stacking ``stack`` consecutive tokens)."""

    kind: str = "projector"
    stack: int = 1
    hidden: Optional[int] = None  # default: the backbone's d_model

    def __post_init__(self) -> None:
        _positive(self, "stack", "hidden")


def _check_decoding(cfg) -> None:
    """The checks shared by the tasks that decode text (``prefix_lm``, ``seq2seq``)."""
    _positive(cfg, "beam_size", "max_new_tokens")
    if cfg.main_metric not in (None, "wer", "cer", "exact_match"):
        raise ValueError(f"main_metric={cfg.main_metric!r}; choose wer, cer or exact_match")
    if cfg.weight < 0:
        raise ValueError(f"weight must be >= 0, got {cfg.weight}")


@dataclass
class PrefixLMTaskConfig:
    """``tasks.<name>`` of kind ``prefix_lm``: captioning or speech recognition — the inputs
    (``tokenizer``: image or audio) as a bidirectional prefix, their caption (``caption_tokenizer``, text)
    generated causally after it through the shared causal backbone and read out by ``caption_head`` (an
    LM head). ``projector``: a head of kind ``projector`` mapping the prefix tokenizer's own tower (a
    pretrained encoder) to the backbone's width (LLaVA). Validation decodes the held-out text (greedy
    with ``beam_size: 1``, else beam search) and reports ``wer``, ``cer`` and ``exact_match``
    (``mmformer.tasks.prefix_lm``)."""

    kind: str = "prefix_lm"
    weight: float = 1.0
    tokenizer: str = MISSING  # image or audio tokenizer: the prefix
    caption_tokenizer: str = MISSING  # text tokenizer
    caption_head: str = MISSING  # its LM head
    projector: Optional[str] = None  # a model.heads entry of kind projector (tower → backbone width)
    beam_size: int = 1  # 1 = greedy decoding
    length_penalty: float = 1.0
    max_new_tokens: Optional[int] = None  # default: data.max_len - 1
    main_metric: Optional[str] = (
        None  # wer | cer | exact_match; default: wer for audio, exact_match for images
    )
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_decoding(self)


@dataclass
class Seq2SeqTaskConfig:
    """``tasks.<name>`` of kind ``seq2seq``: an encoder–decoder (``mmformer.models.encoder_decoder``) —
    the source (``tokenizer``: audio, image or text) is encoded by its own tower (``model.towers``), the
    shared backbone is the decoder (``block: cross``, ``causal: true``) that generates the target text
    (``caption_tokenizer``) read out by ``caption_head`` (an LM head). Teacher forcing in training;
    validation decodes with the KV cache (greedy with ``beam_size: 1``, else beam search) and reports
    ``wer``, ``cer``, ``exact_match``, ``loss`` and ``ppl`` as ``prefix_lm`` does."""

    kind: str = "seq2seq"
    weight: float = 1.0
    tokenizer: str = MISSING  # the source's tokenizer; model.towers.<it> is the encoder
    caption_tokenizer: str = MISSING  # the target text's tokenizer
    caption_head: str = MISSING  # its LM head
    beam_size: int = 1  # 1 = greedy decoding
    length_penalty: float = 1.0
    max_new_tokens: Optional[int] = None  # default: data.max_len - 1
    main_metric: Optional[str] = None  # wer | cer | exact_match; default: wer for audio, else exact_match
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_decoding(self)


# --------------------------------------------------------------------------- top-level sections
@dataclass
class ResamplerConfig:
    """``model.resamplers.<tokenizer>``: a Perceiver resampler after that tokenizer — its tokens, however
    many, reach the backbone as ``num_latents`` tokens (``mmformer.models.resampler``)."""

    num_latents: int = 64
    n_layers: int = 2
    n_heads: int = 8
    mlp_ratio: float = 4.0

    def __post_init__(self) -> None:
        _positive(self, "num_latents", "n_layers", "n_heads")


@dataclass
class ModelConfig:
    tokenizers: dict[str, Any] = field(default_factory=dict)
    backbone: dict[str, Any] = field(default_factory=dict)
    towers: dict[str, Any] = field(default_factory=dict)  # tokenizer name → its own backbone
    resamplers: dict[str, ResamplerConfig] = field(default_factory=dict)  # tokenizer name → a resampler
    heads: dict[str, Any] = field(default_factory=dict)
    lora: Optional[LoRAConfig] = None


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine (or linear / constant) decay to ``min_lr``.
    Norms, biases, position embeddings and class tokens get no weight decay."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.05
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "cosine"  # cosine | linear | constant
    min_lr: float = 0.0
    layer_decay: Optional[float] = None  # layer-wise LR decay: block i of L trains at lr · decay^(L - i)
    ema_decay: Optional[float] = None  # keep an EMA of the weights (validation, checkpoints, sampling use it)
    freeze_pretrained_epochs: int = 0  # the parts of kind pretrained train frozen (linear probe) this long
    # a NaN / inf loss or gradient skips the update on every rank; this many in a row stop the run
    max_nonfinite_steps: int = 5
    # AdamW's kernel (torchtitan's optimizer.implementation): fused (one kernel over all tensors, on CPU
    # and CUDA; the default), foreach (multi-tensor), for-loop (torch's per-tensor reference)
    implementation: str = "fused"

    def __post_init__(self) -> None:
        if self.implementation not in ("fused", "foreach", "for-loop"):
            raise ValueError(f"implementation={self.implementation!r}; choose fused | foreach | for-loop")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {self.ema_decay}")
        if self.name != "adamw":
            raise ValueError(f"optim.name={self.name!r}; only 'adamw' is available")
        _positive(self, "max_nonfinite_steps")
        if self.freeze_pretrained_epochs < 0:
            raise ValueError(f"freeze_pretrained_epochs must be >= 0, got {self.freeze_pretrained_epochs}")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"schedule={self.schedule!r}; choose cosine | linear | constant")
        if len(self.betas) != 2:
            raise ValueError(f"betas needs 2 values, got {self.betas}")
        if self.layer_decay is not None and not 0.0 < self.layer_decay <= 1.0:
            raise ValueError(f"layer_decay must be in (0, 1], got {self.layer_decay}")


@dataclass
class TrainerConfig:
    """Lightning ``Trainer`` arguments (the subset recipes may set)."""

    accelerator: str = "auto"
    devices: Any = "auto"  # int | "auto" | list of ids
    strategy: str = "auto"  # auto | ddp | fsdp2 (any device, CPU too) | fsdp (GPU) | any Lightning name
    num_nodes: int = 1
    precision: str = "32-true"
    max_epochs: Optional[int] = None
    max_steps: int = -1
    max_time: Optional[str] = None  # "DD:HH:MM:SS"
    gradient_clip_val: Optional[float] = 1.0
    gradient_clip_algorithm: str = "norm"
    accumulate_grad_batches: int = 1
    log_every_n_steps: int = 10
    val_check_interval: Optional[Any] = None
    check_val_every_n_epoch: Optional[int] = 1
    limit_train_batches: Optional[Any] = None
    limit_val_batches: Optional[Any] = None
    num_sanity_val_steps: int = 2
    validate_first: bool = False  # validate once before training (a fine-tune's "before" numbers)
    deterministic: Optional[bool] = None
    enable_progress_bar: bool = True
    compile: bool = False  # torch.compile every transformer block (models.parallelize; keys stay clean)
    activation_checkpointing: bool = False  # recompute each block's activations in backward


@dataclass
class LoggerConfig:
    """W&B: ``auto`` = online when credentials exist, offline otherwise. A CSV log is always written."""

    mode: str = "auto"  # auto | online | offline | disabled
    project: str = "mmformer"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "online", "offline", "disabled"):
            raise ValueError(f"mode={self.mode!r}; choose auto | online | offline | disabled")


@dataclass
class CheckpointConfig:
    monitor: Optional[str] = None  # default: the first task's main validation metric
    mode: Optional[str] = None  # min | max; default: the monitored metric's own direction
    save_top_k: int = 1
    every_n_train_steps: Optional[int] = None  # also refresh last.ckpt every N optimizer steps
    save_last: bool = True
    # trainer.strategy fsdp2: every rank writes its own shard (a folder) instead of rank 0 the whole
    # state; `mmformer export CKPT --format safetensors` merges one into a single file
    sharded: bool = False

    def __post_init__(self) -> None:
        if self.mode not in (None, "min", "max"):
            raise ValueError(f"mode={self.mode!r}; choose min or max")
        _positive(self, "every_n_train_steps")


@dataclass
class MultiTaskConfig:
    """``multitask``: how a recipe with several tasks mixes them in training.

    ``schedule: all`` — every step holds one batch of every task and the loss is the sum of the tasks'
    losses times their ``weight`` (each task's data cycles until the longest is done).
    ``schedule: sampled`` — every step holds one task's batch, drawn with probability proportional to
    ``sample_weights`` (default: each task's number of training batches, so an epoch visits every task's
    data once in expectation), the same task on every rank by default: PolyViT's task sampling
    (Likhosherstov et al. 2021, §3.2). ``steps_per_epoch`` defaults to the sum of the tasks' batches.
    ``check_leaks`` refuses a recipe where one task's validation samples are another task's training
    samples (files compared by content, corpus documents and texts to classify by text).
    ``only: [task, …]`` trains a subset of the tasks (dropping the model parts only the others use):
    the single-task runs to compare a joint run with, from the same recipe.
    """

    schedule: str = "all"  # all | sampled
    sample_weights: dict[str, float] = field(default_factory=dict)
    steps_per_epoch: Optional[int] = None
    same_task_on_all_ranks: bool = True
    check_leaks: bool = True
    only: list[str] = field(default_factory=list)  # train just these tasks (single-task comparisons)

    def __post_init__(self) -> None:
        if self.schedule not in ("all", "sampled"):
            raise ValueError(f"schedule={self.schedule!r}; choose all | sampled")
        _positive(self, "steps_per_epoch")
        for name, w in self.sample_weights.items():
            if not w >= 0:
                raise ValueError(f"sample_weights.{name} must be >= 0, got {w}")
        if self.sample_weights and not sum(self.sample_weights.values()) > 0:
            raise ValueError("sample_weights are all zero: no task would ever train")


@dataclass
class RecipeConfig:
    name: str = MISSING
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    tasks: dict[str, Any] = field(default_factory=dict)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    multitask: MultiTaskConfig = field(default_factory=MultiTaskConfig)
    resume: Optional[str] = None  # auto | PATH to a .ckpt


# --------------------------------------------------------------------------- loading
def load_recipe(source: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RecipeConfig:
    """Load a recipe file (``recipe_from_yaml`` loads YAML text, e.g. from a checkpoint).

    Raises:
        RecipeError: unreadable YAML, unknown keys (with a did-you-mean), wrong types, bad values.
        FileNotFoundError: the recipe file does not exist.
    """
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"recipe file not found: {path}")
    try:
        raw = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and friends
        raise RecipeError(f"{path}: not valid YAML: {e}") from e
    return _resolve(raw, overrides, str(path))


def recipe_from_yaml(text: str, overrides: list[str] | tuple[str, ...] = ()) -> RecipeConfig:
    """Load a recipe from YAML text (as stored in checkpoints)."""
    return _resolve(OmegaConf.create(text), overrides, "<yaml>")


def recipe_to_yaml(recipe: RecipeConfig) -> str:
    """The resolved recipe, defaults included, as plain YAML text (reloads to an equal recipe)."""
    return OmegaConf.to_yaml(OmegaConf.create(recipe_to_dict(recipe)))


def recipe_to_dict(recipe: RecipeConfig) -> dict:
    """The resolved recipe as plain dicts / lists / scalars (for loggers and YAML)."""
    return asdict(recipe)


def _resolve(raw: DictConfig, overrides, origin: str) -> RecipeConfig:
    if not isinstance(raw, DictConfig):
        raise RecipeError(f"{origin}: a recipe must be a mapping of sections, got {type(raw).__name__}")
    cfg = _guard("", lambda: OmegaConf.merge(OmegaConf.structured(RecipeConfig), raw), RecipeConfig)
    for item in overrides:
        key, value = _parse_override(item)
        _guard("", lambda k=key, v=value: OmegaConf.update(cfg, k, v, merge=True), RecipeConfig, key)
    _guard("", lambda: OmegaConf.resolve(cfg), RecipeConfig)
    for f in fields(RecipeConfig):  # validate section by section, so errors name their section
        if is_dataclass(f.type) or f.name in ("optim", "trainer", "logger", "checkpoint", "multitask"):
            _guard(f.name, lambda n=f.name: OmegaConf.to_object(cfg[n]), RecipeConfig)
    recipe: RecipeConfig = _guard("", lambda: OmegaConf.to_object(cfg), RecipeConfig)

    model = recipe.model
    model.backbone = _component("backbone", model.backbone, "model.backbone", default_kind="transformer")
    model.tokenizers = {
        k: _component("tokenizer", v, f"model.tokenizers.{k}") for k, v in model.tokenizers.items()
    }
    model.towers = {
        k: _component("backbone", v, f"model.towers.{k}", default_kind="transformer")
        for k, v in model.towers.items()
    }
    model.heads = {k: _component("head", v, f"model.heads.{k}") for k, v in model.heads.items()}
    tasks = {}
    for name, node in recipe.tasks.items():
        task = _component("task", node, f"tasks.{name}")
        task.data = _component("dataset", task.data, f"tasks.{name}.data")
        tasks[name] = task
    recipe.tasks = tasks
    if recipe.multitask.only:
        _keep_only(recipe, recipe.multitask.only)
    _check_references(recipe)
    return recipe


# The task fields that name model parts: tokenizers (a contrastive, diffusion or prefix-LM task's
# captions read a second one) and heads (a caption head, a prefix-LM's projector).
TOKENIZER_REFS = ("tokenizer", "caption_tokenizer")
HEAD_REFS = ("head", "caption_head", "projector")


def _referenced(tasks, fields: tuple[str, ...]) -> set[str]:
    return {getattr(t, f) for t in tasks for f in fields if getattr(t, f, None) is not None}


def _keep_only(recipe: RecipeConfig, names: list[str]) -> None:
    """``multitask.only``: train a subset of a multi-task recipe's tasks (the single-task runs a joint
    run is compared with): the other tasks, and the tokenizers, towers and heads only they use, are
    dropped; the recipe's name gets ``-only-<tasks>``."""
    unknown = [n for n in names if n not in recipe.tasks]
    if unknown:
        close = difflib.get_close_matches(unknown[0], recipe.tasks, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise RecipeError(
            f"'multitask.only' names {unknown[0]!r}, which is not a task ({', '.join(recipe.tasks)}).{hint}"
        )
    recipe.tasks = {n: t for n, t in recipe.tasks.items() if n in names}
    tokenizers, heads = (
        _referenced(recipe.tasks.values(), TOKENIZER_REFS),
        _referenced(recipe.tasks.values(), HEAD_REFS),
    )
    m = recipe.model
    m.tokenizers = {k: v for k, v in m.tokenizers.items() if k in tokenizers}
    m.towers = {k: v for k, v in m.towers.items() if k in tokenizers}
    m.heads = {k: v for k, v in m.heads.items() if k in heads}
    mt = recipe.multitask
    mt.sample_weights = {k: v for k, v in mt.sample_weights.items() if k in names}
    if len(recipe.tasks) == 1:  # nothing left to sample from
        mt.schedule, mt.sample_weights, mt.steps_per_epoch = "all", {}, None
    monitor = recipe.checkpoint.monitor or ""
    if monitor.count("/") >= 2 and monitor.split("/")[1] not in recipe.tasks:
        recipe.checkpoint.monitor = None  # it named a dropped task: the kept task's main metric instead
    suffix = "-only-" + "-".join(names)
    if not recipe.name.endswith(suffix):
        recipe.name += suffix


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise RecipeError(f"override {item!r} is not of the form key=value (e.g. optim.lr=3e-4)")
    key, _, text = item.partition("=")
    value = OmegaConf.from_dotlist([f"v={text}"]).v  # YAML typing: 1e-3 float, null None, false bool
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    return key.strip(), value


def _component(group: str, node: Any, where: str, default_kind: str | None = None):
    """Validate one component node against the dataclass registered for its ``kind``."""
    if not isinstance(node, dict):
        raise RecipeError(f"'{where}' must be a mapping with a 'kind', got {node!r}")
    kind = node.get("kind", default_kind)
    if kind is None:
        raise RecipeError(f"'{where}' needs a 'kind' (the {group} to build)")
    try:
        entry = lookup(group, kind, where + ".kind")
    except KeyError as e:
        raise RecipeError(e.args[0]) from None
    node = dict(node, kind=kind)
    merged = _guard(where, lambda: OmegaConf.merge(OmegaConf.structured(entry.config), node), entry.config)
    return _guard(where, lambda: OmegaConf.to_object(merged), entry.config)


def _guard(prefix: str, fn, schema: type, key_hint: str | None = None):
    """Run an OmegaConf operation, turning its errors into a RecipeError naming the full key."""
    try:
        return fn()
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or key_hint or ""
        full = f"{prefix}.{key}" if prefix and key else (prefix or key)
        first = str(e).split("\n")[0]
        if "not in" in first or "Key '" in first and "not" in first:
            raise RecipeError(_unknown_key_message(full, schema, key)) from None
        if "Missing mandatory value" in first:
            raise RecipeError(f"'{full}' is required but not set") from None
        m = re.match(r"Value '(.*)' of type '(.*)' could not be converted to (\w+)", first)
        if m:
            expected = {"Integer": "int", "Float": "float", "Boolean": "bool", "String": "str"}.get(
                m.group(3), m.group(3)
            )
            raise RecipeError(f"'{full}' expects {expected}, got {m.group(1)!r} ({m.group(2)})") from None
        raise RecipeError(f"'{full}': {first}") from None
    except (ValueError, TypeError, KeyError) as e:
        if isinstance(e, RecipeError):
            raise
        raise RecipeError(f"'{prefix or schema.__name__}': {e.args[0] if e.args else e}") from None


def _unknown_key_message(full: str, schema: type, key: str) -> str:
    parent = _schema_at(schema, key.split(".")[:-1]) if key else None
    last = full.split(".")[-1]
    options = [f.name for f in fields(parent)] if parent else []
    close = difflib.get_close_matches(last, options, n=1, cutoff=0.5)
    base = full.rsplit(".", 1)[0] + "." if "." in full else ""
    hint = f" Did you mean '{base}{close[0]}'?" if close else ""
    valid = f" Valid keys here: {', '.join(options)}." if options else ""
    return f"unknown recipe key '{full}'.{hint}{valid}"


def _schema_at(schema: type, path: list[str]) -> type | None:
    """The dataclass that describes the node at ``path`` inside ``schema`` (None when free-form)."""
    import typing

    cls = schema
    for part in path:
        if not is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        cls = hints[part]
        if typing.get_origin(cls) is not None:  # dict / list / Optional: free-form below here
            return None
    return cls if is_dataclass(cls) else None


def _check_references(recipe: RecipeConfig) -> None:
    if not recipe.tasks:
        raise RecipeError("the recipe has no 'tasks'; add at least one (e.g. tasks: {mnist: {kind: ...}})")
    t = recipe.trainer
    if t.max_steps in (None, -1) and t.max_epochs in (None, -1):
        raise RecipeError(
            "set 'trainer.max_epochs' or 'trainer.max_steps': the LR schedule needs the run's length"
        )
    for name, task in recipe.tasks.items():
        for attr, table in (("tokenizer", recipe.model.tokenizers), ("head", recipe.model.heads)):
            ref = getattr(task, attr, None)
            if ref is not None and ref not in table:
                close = difflib.get_close_matches(ref, table, n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                raise RecipeError(
                    f"'tasks.{name}.{attr}' refers to {ref!r}, which is not in model.{attr}s "
                    f"({', '.join(table) or 'none defined'}).{hint}"
                )
        head = recipe.model.heads.get(getattr(task, "head", None))
        tok = recipe.model.tokenizers.get(getattr(task, "tokenizer", None))
        seq_len, max_len = getattr(task.data, "seq_len", None), getattr(tok, "max_len", None)
        if seq_len and max_len and seq_len > max_len:
            raise RecipeError(
                f"'tasks.{name}.data.seq_len' is {seq_len} but tokenizer '{task.tokenizer}' has learned "
                f"positions up to max_len={max_len}; raise max_len or shorten seq_len"
            )
        if getattr(head, "pool", None) == "cls" and getattr(tok, "class_token", True) is False:
            raise RecipeError(
                f"'model.heads.{task.head}.pool' is 'cls' but tokenizer '{task.tokenizer}' has "
                "class_token: false; use pool: mean or enable the class token"
            )

    mt = recipe.multitask
    for name in mt.sample_weights:
        if name not in recipe.tasks:
            close = difflib.get_close_matches(name, recipe.tasks, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise RecipeError(
                f"'multitask.sample_weights.{name}' names no task (tasks: {', '.join(recipe.tasks)}).{hint}"
            )
    missing = [n for n in recipe.tasks if n not in mt.sample_weights]
    if mt.sample_weights and missing:
        raise RecipeError(
            f"'multitask.sample_weights' gives no weight to {', '.join(missing)}: list every task (0 to skip one)"
        )
    if mt.sample_weights and mt.schedule != "sampled":
        raise RecipeError("'multitask.sample_weights' needs multitask.schedule: sampled")
    if mt.steps_per_epoch is not None and mt.schedule != "sampled":
        raise RecipeError("'multitask.steps_per_epoch' needs multitask.schedule: sampled")
    gathering = [n for n, t in recipe.tasks.items() if t.kind == "contrastive"]
    if mt.schedule == "sampled" and not mt.same_task_on_all_ranks and gathering and len(recipe.tasks) > 1:
        raise RecipeError(
            f"'multitask.same_task_on_all_ranks: false' would hang: task {gathering[0]!r} gathers features "
            "from every rank inside its step, so all ranks must run it at the same step (set it to true)"
        )
    if recipe.checkpoint.sharded and recipe.trainer.strategy != "fsdp2":
        raise RecipeError(
            "'checkpoint.sharded: true' needs trainer.strategy: fsdp2 (to validate a sharded run's "
            "checkpoint with another strategy, add checkpoint.sharded=false)"
        )
    if recipe.trainer.strategy == "fsdp2":
        if mt.schedule == "sampled" and not mt.same_task_on_all_ranks and len(recipe.tasks) > 1:
            raise RecipeError(
                "'multitask.same_task_on_all_ranks: false' would hang under trainer.strategy: fsdp2: every "
                "rank gathers each block's weights together, so all ranks must run the same task"
            )
        if recipe.optim.freeze_pretrained_epochs and recipe.checkpoint.sharded:
            raise RecipeError(
                "optim.freeze_pretrained_epochs with checkpoint.sharded: true is not supported (a part frozen "
                "since the start has no optimizer state to shard): set checkpoint.sharded=false"
            )
        if recipe.optim.ema_decay is not None and recipe.checkpoint.sharded:
            raise RecipeError(
                "optim.ema_decay with checkpoint.sharded: true is not supported (the average is kept per "
                "shard but written only into whole checkpoints): set checkpoint.sharded=false"
            )

    for name in recipe.model.resamplers:
        if name not in recipe.model.tokenizers:
            close = difflib.get_close_matches(name, recipe.model.tokenizers, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise RecipeError(
                f"'model.resamplers.{name}' names no tokenizer: model.tokenizers has "
                f"{', '.join(recipe.model.tokenizers) or 'none'}.{hint}"
            )
    for name in recipe.model.towers:
        if name not in recipe.model.tokenizers:
            close = difflib.get_close_matches(name, recipe.model.tokenizers, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise RecipeError(
                f"'model.towers.{name}' names no tokenizer (a tower reads one tokenizer's tokens): "
                f"model.tokenizers has {', '.join(recipe.model.tokenizers) or 'none'}.{hint}"
            )
    if recipe.model.towers:
        if recipe.model.lora is not None:
            raise RecipeError(
                "'model.lora' adapts the shared backbone only; it cannot be combined with towers yet"
            )
        if set(recipe.model.towers) >= set(recipe.model.tokenizers):
            raise RecipeError(
                "every tokenizer has a tower, so the shared 'model.backbone' would read nothing: give one "
                "modality the shared backbone (remove its entry from model.towers)"
            )
        for task in recipe.tasks.values():
            if task.kind == "diffusion":
                for attr in ("tokenizer", "caption_tokenizer"):
                    if getattr(task, attr, None) in recipe.model.towers:
                        raise RecipeError(
                            f"'model.towers.{getattr(task, attr)}': a diffusion task reads its tokenizers "
                            "through the shared adaLN backbone (captions are pooled embeddings); remove the tower"
                        )
    for name, task in recipe.tasks.items():
        for attr, table in (
            ("caption_tokenizer", recipe.model.tokenizers),
            ("caption_head", recipe.model.heads),
            ("projector", recipe.model.heads),
        ):
            ref = getattr(task, attr, None)
            if ref is not None and ref not in table:
                close = difflib.get_close_matches(ref, table, n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                kind = "heads" if table is recipe.model.heads else "tokenizers"
                raise RecipeError(
                    f"'tasks.{name}.{attr}' refers to {ref!r}, which is not in "
                    f"model.{kind} ({', '.join(table) or 'none defined'}).{hint}"
                )
    for attr, table, refs in (
        ("tokenizer", recipe.model.tokenizers, TOKENIZER_REFS),
        ("head", recipe.model.heads, HEAD_REFS),
    ):
        used = _referenced(recipe.tasks.values(), refs)
        for name in table:
            if name not in used:  # an unused part would be trained by nobody (and breaks DDP)
                raise RecipeError(
                    f"'model.{attr}s.{name}' is not used by any task; remove it or point a "
                    f"task's '{attr}' at it"
                )
