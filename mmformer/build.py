"""The composition root: turns a resolved recipe into model, datamodule, LightningModule, callbacks,
loggers and Trainer. The built-in components are registered here; users register theirs with
``mmformer.registry.register`` (same signatures as the builders below).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import os
import sys
from types import SimpleNamespace

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.strategies import DDPStrategy

from .config import (
    ASTConfig,
    AudioCaptionDataConfig,
    AudioFolderDataConfig,
    AudioManifestDataConfig,
    BackboneConfig,
    BPEConfig,
    CausalLMTaskConfig,
    CIFAR10DataConfig,
    ClassificationTaskConfig,
    ClassifierHeadConfig,
    ContrastiveTaskConfig,
    DiffusionTaskConfig,
    DiTHeadConfig,
    DiTTokenizerConfig,
    ImageCaptionDataConfig,
    ImageFolderDataConfig,
    LMHeadConfig,
    MaskedLMTaskConfig,
    MLMHeadConfig,
    PrefixLMTaskConfig,
    PretrainedBackboneConfig,
    PretrainedHeadConfig,
    PretrainedTokenizerConfig,
    ProjectionHeadConfig,
    ProjectorHeadConfig,
    RecipeConfig,
    RecipeError,
    Seq2SeqTaskConfig,
    ShardsDataConfig,
    TextClassificationDataConfig,
    TextDataConfig,
    ViTPatchConfig,
    WhisperConvConfig,
    recipe_to_dict,
    recipe_to_yaml,
)
from .data.audio import audio_classification_data, manifest_rows
from .data.audio_caption import audio_caption_data
from .data.datamodule import MultiTaskDataModule
from .data.image import cifar10_data, image_folder_data
from .data.image_caption import encode_captions, image_caption_data, read_captions, read_class_prompts
from .data.leaks import check_no_leaks
from .data.roots import DataError, DataNotFoundError, resolve_root
from .data.text import corpus_split, text_data
from .data.text_classification import text_classification_data
from .models import Backbone, ClassifierHead, MultimodalModel, build_backbone
from .models.diffusion import GaussianDiffusion, RectifiedFlow, beta_schedule
from .models.encoder_decoder import EncoderDecoder
from .models.heads import DiTFinalLayer, LMHead, MLMHead, ProjectionHead, ProjectorHead
from .models.prefix_lm import PrefixLM
from .models.pretrained import (
    FAMILY_MODALITY,
    Pretrained,
    load_pretrained,
    load_pretrained_tokenizer,
    pretrained_family,
    resolve_pretrained,
)
from .models.pretrained.timm_vit import LoadReport, adapt_classifier, adapt_tokenizer, describe_timm_vit
from .models.resampler import PerceiverResampler, ResampledTokenizer
from .nn.lora import apply_lora
from .nn.tokens import MODALITY_IDS
from .registry import lookup, register
from .tasks import ClassificationTask, MultiTaskModule
from .tasks.contrastive import ContrastiveTask
from .tasks.diffusion import DiffusionTask
from .tasks.language_model import CausalLMTask
from .tasks.masked_lm import MaskedLMTask
from .tasks.prefix_lm import PrefixLMTask
from .tasks.seq2seq import Seq2SeqTask
from .tokenizers import ViTPatchTokenizer
from .tokenizers.audio import (
    ASTPatchTokenizer,
    AudioPreprocess,
    LogMel,
    SpecAugment,
    WhisperConvTokenizer,
)
from .tokenizers.diffusion import DiTTokenizer
from .tokenizers.text import MASK_TOKEN, TextEmbedding, TextTokenizer
from .training.callbacks import (
    AudioSamples,
    BadSampleReport,
    DecodedSamples,
    DiffusionSamples,
    EMAWeights,
    TextSamples,
    ThroughputLogger,
)
from .training.checkpoint_io import AtomicCheckpointIO, LastCheckpoint
from .training.freeze import FreezePretrained
from .training.fsdp2 import FSDP2Strategy
from .training.loggers import build_loggers
from .training.preemption import StopOnSignal
from .training.runs import Run, RunFolder
from .training.sharded_ema import ShardedEMAWeights


# --------------------------------------------------------------------------- built-in components
@register("backbone", "transformer", BackboneConfig)
def build_transformer(cfg: BackboneConfig) -> Backbone:
    kwargs = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.name not in ("kind", "preset", "bidirectional")
    }
    kwargs["bidirectional_modalities"] = tuple(MODALITY_IDS[m] for m in cfg.bidirectional)
    return build_backbone(**kwargs)


@register("tokenizer", "vit_patch", ViTPatchConfig)
def build_vit_patch(cfg: ViTPatchConfig, d_model: int) -> ViTPatchTokenizer:
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
def build_ast(cfg: ASTConfig, d_model: int) -> ASTPatchTokenizer:
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
def build_whisper_conv(cfg: WhisperConvConfig, d_model: int) -> WhisperConvTokenizer:
    n_ctx = int(round(cfg.max_seconds * 100)) // 2 + 1  # 100 frames/s, stride 2
    return WhisperConvTokenizer(d_model, cfg.n_mels, n_ctx, SpecAugment(cfg.freq_mask, cfg.time_mask))


@register("tokenizer", "dit", DiTTokenizerConfig)
def build_dit_tokenizer(cfg: DiTTokenizerConfig, d_model: int) -> DiTTokenizer:
    return DiTTokenizer(
        d_model,
        cfg.image_size,
        cfg.patch_size,
        cfg.in_chans,
        cfg.num_classes,
        cfg.class_dropout,
        cfg.text_conditional,
    )


@register("head", "dit", DiTHeadConfig)
def build_dit_head(cfg: DiTHeadConfig, d_model: int, tokenizer) -> DiTFinalLayer:
    if not isinstance(tokenizer, DiTTokenizer):
        raise RecipeError("a 'dit' head needs a diffusion task whose tokenizer is of kind dit")
    out_chans = tokenizer.in_chans * (2 if cfg.learn_sigma else 1)
    return DiTFinalLayer(d_model, tokenizer.patch_size, tokenizer.grid_size, out_chans)


@register("task", "diffusion", DiffusionTaskConfig)
def build_diffusion(cfg: DiffusionTaskConfig, recipe: RecipeConfig) -> DiffusionTask:
    tok, head = recipe.model.tokenizers[cfg.tokenizer], recipe.model.heads[cfg.head]
    if tok.kind != "dit" or head.kind != "dit":
        raise RecipeError(
            f"task kind 'diffusion' needs a tokenizer and a head of kind dit, got {tok.kind}, {head.kind}"
        )
    bb = recipe.model.backbone
    if bb.kind == "transformer" and bb.block != "adaln":
        raise RecipeError("a diffusion task conditions through adaLN: set model.backbone.block: adaln")
    if bb.kind == "transformer" and bb.d_cond not in (None, bb.d_model):
        raise RecipeError(
            f"model.backbone.d_cond={bb.d_cond}: the DiT tokenizer's conditioning has d_model width"
        )
    if tok.text_conditional != (cfg.caption_tokenizer is not None):
        raise RecipeError(
            "a text-conditional DiT needs both the tokenizer's text_conditional: true and the task's "
            "caption_tokenizer (a text tokenizer in model.tokenizers)"
        )
    if cfg.caption_tokenizer is not None:
        if cfg.caption_tokenizer not in recipe.model.tokenizers:
            raise RecipeError(f"caption_tokenizer {cfg.caption_tokenizer!r} is not in model.tokenizers")
        if tokenizer_modality(recipe.model.tokenizers[cfg.caption_tokenizer]) != "text":
            raise RecipeError(f"caption_tokenizer {cfg.caption_tokenizer!r} must be a text tokenizer (bpe)")
    if (tok.num_classes or tok.text_conditional) and tok.class_dropout == 0 and cfg.sample_cfg_scale != 1:
        raise RecipeError(
            "classifier-free guidance (sample_cfg_scale != 1) needs the null class trained: set the "
            "tokenizer's class_dropout > 0 (e.g. 0.1) or tasks.<name>.sample_cfg_scale: 1"
        )
    defaults = DiffusionTaskConfig(tokenizer="", head="")
    if cfg.objective == "flow":
        ignored = [
            k
            for k in (
                "num_timesteps",
                "beta_schedule",
                "beta_start",
                "beta_end",
                "prediction",
                "min_snr_gamma",
            )
            if getattr(cfg, k) != getattr(defaults, k)
        ]
        if ignored:
            raise RecipeError(f"{', '.join(ignored)} apply to objective: gaussian, not flow; remove them")
    elif cfg.t_sampling != defaults.t_sampling:
        raise RecipeError("t_sampling applies to objective: flow; remove it")
    elif cfg.sample_steps > cfg.num_timesteps:
        raise RecipeError(f"sample_steps={cfg.sample_steps} exceeds num_timesteps={cfg.num_timesteps}")
    if cfg.objective == "flow":
        if head.learn_sigma:
            raise RecipeError(
                "learn_sigma is for objective: gaussian (rectified flow has no variance to learn)"
            )
        process = RectifiedFlow(cfg.t_sampling)
    else:
        betas = beta_schedule(cfg.beta_schedule, cfg.num_timesteps, cfg.beta_start, cfg.beta_end)
        process = GaussianDiffusion(betas, cfg.prediction, learned_variance=head.learn_sigma)
    return DiffusionTask(
        cfg.tokenizer,
        cfg.head,
        process,
        cfg.min_snr_gamma,
        sample_cfg_scale=cfg.sample_cfg_scale,
        sample_steps=cfg.sample_steps,
        samples_per_class=cfg.samples_per_class,
        caption_tokenizer=cfg.caption_tokenizer,
        conditional=bool(tok.num_classes or tok.text_conditional) and tok.class_dropout > 0,
    )


def _audio_preprocess(tok_cfg) -> tuple[AudioPreprocess, AudioPreprocess]:
    """(train, val) data sides: augmentation on the training clips only."""
    rate, seconds = tok_cfg.sample_rate, tok_cfg.max_seconds
    train = AudioPreprocess(
        rate, seconds, tok_cfg.random_crop, tok_cfg.gain_db, tok_cfg.shift_seconds, tok_cfg.noise_snr_db
    )
    return train, AudioPreprocess(rate, seconds)


@register("dataset", "audio_folder", AudioFolderDataConfig)
def build_audio_folder(cfg: AudioFolderDataConfig, task, recipe: RecipeConfig):
    tok = recipe.model.tokenizers[task.tokenizer]
    return audio_classification_data(cfg, _audio_preprocess(tok), _num_classes(task, recipe))


@register("dataset", "audio_manifest", AudioManifestDataConfig)
def build_audio_manifest(cfg: AudioManifestDataConfig, task, recipe: RecipeConfig):
    tok = recipe.model.tokenizers[task.tokenizer]
    return audio_classification_data(cfg, _audio_preprocess(tok), _num_classes(task, recipe))


@register("tokenizer", "bpe", BPEConfig)
def build_bpe(cfg: BPEConfig, d_model: int, vocab_size: int) -> TextEmbedding:
    return TextEmbedding(vocab_size, d_model, cfg.max_len)


def _vocabulary_head(cls, kind: str, cfg, d_model: int, tokenizer):
    """An ``lm`` / ``mlm`` head over the text tokenizer's vocabulary, tied to its embedding when asked."""
    if not isinstance(tokenizer, TextEmbedding):
        raise RecipeError(f"an '{kind}' head needs a task whose tokenizer is a text tokenizer")
    head = cls(d_model, tokenizer.vocab_size)
    if cfg.tie_weights:
        head.tie_to(tokenizer.embed)
    return head


@register("head", "lm", LMHeadConfig)
def build_lm_head(cfg: LMHeadConfig, d_model: int, tokenizer) -> LMHead:
    return _vocabulary_head(LMHead, "lm", cfg, d_model, tokenizer)


@register("head", "mlm", MLMHeadConfig)
def build_mlm_head(cfg: MLMHeadConfig, d_model: int, tokenizer) -> MLMHead:
    return _vocabulary_head(MLMHead, "mlm", cfg, d_model, tokenizer)


@register("task", "masked_lm", MaskedLMTaskConfig)
def build_masked_lm(cfg: MaskedLMTaskConfig, recipe: RecipeConfig) -> MaskedLMTask:
    backbone = recipe.model.backbone
    if getattr(backbone, "causal", False):
        raise RecipeError("a masked_lm task needs a bidirectional backbone: set model.backbone.causal: false")
    tok = text_tokenizer(recipe, cfg.tokenizer)
    if tok.mask_id is None:
        raise RecipeError(
            f"'model.tokenizers.{cfg.tokenizer}' has no mask token: use a BPE trained by mmformer (a masked_lm "
            "task adds <|mask|>) or a BERT tokenizer"
        )
    specials = [
        i
        for i in (tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id, tok.image_id, tok.audio_id)
        if i is not None
    ]
    return MaskedLMTask(
        cfg.tokenizer, cfg.head, tok.mask_id, tok.vocab_size, specials, cfg.mask_prob, recipe.seed
    )


@register("task", "causal_lm", CausalLMTaskConfig)
def build_causal_lm(cfg: CausalLMTaskConfig, recipe: RecipeConfig) -> CausalLMTask:
    return CausalLMTask(cfg.tokenizer, cfg.head)


@register("dataset", "text", TextDataConfig)
def build_text_data(cfg: TextDataConfig, task, recipe: RecipeConfig):
    return text_data(cfg, text_tokenizer(recipe, task.tokenizer), recipe.seed)


# --------------------------------------------------------------------------- pretrained weights
# One build_model call loads each source once, so its tokenizer, backbone and head share tensors (a tied
# LM head stays tied); a second build gets fresh modules.
_BUILD_SESSION: dict[str, Pretrained] | None = None
MODALITY_OF_KIND = {
    "bpe": "text",
    "ast": "audio",
    "whisper_conv": "audio",
    "vit_patch": "image",
    "dit": "image",
}


def tokenizer_modality(cfg) -> str:
    """``text``, ``audio`` or ``image``: what a tokenizer config reads (pretrained ones by their family);
    users' own kinds declare a ``modality`` attribute on their config, default ``image``."""
    if cfg.kind == "pretrained":
        pinned = _PINNED_PRETRAINED.get(cfg.source)
        return FAMILY_MODALITY[pinned["family"] if pinned else pretrained_family(cfg.source)]
    return MODALITY_OF_KIND.get(cfg.kind, getattr(cfg, "modality", "image"))


_PINNED_PRETRAINED: dict[str, dict] = {}


def pin_pretrained(entries: dict[str, dict]) -> None:
    """Build these pretrained sources (``{source: {"family", "config"}}``, what a checkpoint carries)
    from their configs without reading their weights: the checkpoint's state dict supplies them, so a
    fine-tuned checkpoint needs neither the original file nor its package."""
    _PINNED_PRETRAINED.clear()
    _PINNED_PRETRAINED.update(entries)


def _architecture(source: str) -> Pretrained:
    from .models.pretrained import build_bert, build_llama, build_timm_vit
    from .models.pretrained.whisper import build_whisper_encoder

    entry = _PINNED_PRETRAINED[source]
    build = {
        "llama": build_llama,
        "bert": build_bert,
        "whisper": build_whisper_encoder,
        "timm_vit": build_timm_vit,
    }[entry["family"]]
    return Pretrained(build(entry["config"]), None, entry["config"], entry["family"], source)


def _pretrained(source: str) -> Pretrained:
    load = _architecture if source in _PINNED_PRETRAINED else load_pretrained
    if _BUILD_SESSION is None:
        return load(source)
    # one load per file, however the recipe spells it
    key = source if source in _PINNED_PRETRAINED else str(resolve_pretrained(source).resolve())
    if key not in _BUILD_SESSION:
        _BUILD_SESSION[key] = load(source)
        _BUILD_SESSION[key].source = source
    return _BUILD_SESSION[key]


def _freeze(module, frozen: bool = True) -> None:
    for p in module.parameters():
        p.requires_grad_(not frozen)


@register("backbone", "pretrained", PretrainedBackboneConfig)
def build_pretrained_backbone(cfg: PretrainedBackboneConfig) -> Backbone:
    backbone = _pretrained(cfg.source).model.backbone
    if cfg.freeze_layers > len(backbone.blocks):
        raise RecipeError(
            f"'model.backbone.freeze_layers' is {cfg.freeze_layers} but {cfg.source} has "
            f"{len(backbone.blocks)} blocks"
        )
    for block in backbone.blocks[: cfg.freeze_layers]:
        _freeze(block)
    if cfg.freeze_layers == len(backbone.blocks):  # the whole backbone: its final norm too
        _freeze(backbone.norm)
    return backbone


def _timm_report(pretrained: Pretrained) -> LoadReport:
    if pretrained.report is None:  # rebuilt from a checkpoint: nothing was read from the source
        pretrained.report = LoadReport(pretrained.source)
    return pretrained.report


@register("tokenizer", "pretrained", PretrainedTokenizerConfig)
def build_pretrained_tokenizer(cfg: PretrainedTokenizerConfig, d_model: int):
    pretrained = _pretrained(cfg.source)
    (tokenizer,) = pretrained.model.tokenizers.values()
    if pretrained.family == "timm_vit":
        try:
            tokenizer, _ = adapt_tokenizer(
                tokenizer, pretrained.config, _timm_report(pretrained), cfg.image_size, cfg.in_chans
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
    if cfg.freeze:
        _freeze(tokenizer)
    return tokenizer


@register("head", "pretrained", PretrainedHeadConfig)
def build_pretrained_head(cfg: PretrainedHeadConfig, d_model: int, tokenizer):
    pretrained = _pretrained(cfg.source)
    heads = list(pretrained.model.heads.values())
    if len(heads) != 1:
        raise RecipeError(f"{cfg.source} carries no head to reuse; add a new head (e.g. kind: classifier)")
    if pretrained.family == "timm_vit":
        return adapt_classifier(
            heads[0], cfg.num_classes or heads[0].head.out_features, _timm_report(pretrained)
        )
    if cfg.num_classes is not None:
        raise RecipeError(f"num_classes applies to a timm ViT's classifier; {cfg.source} is not one")
    if tokenizer is not None and tokenizer not in pretrained.model.tokenizers.values():
        raise RecipeError(
            f"a pretrained head of {cfg.source} reads its own vocabulary: the task's tokenizer must be "
            f"{{kind: pretrained, source: {cfg.source}}} too"
        )
    return heads[0]


@register("dataset", "text_classification", TextClassificationDataConfig)
def build_text_classification_data(cfg: TextClassificationDataConfig, task, recipe: RecipeConfig):
    return text_classification_data(
        cfg, text_tokenizer(recipe, task.tokenizer), _num_classes(task, recipe), recipe.seed
    )


@register("head", "classifier", ClassifierHeadConfig)
def build_classifier(cfg: ClassifierHeadConfig, d_model: int, tokenizer) -> ClassifierHead:
    return ClassifierHead(
        d_model, cfg.num_classes, cfg.pool, getattr(tokenizer, "num_prefix_tokens", 0), cfg.fc_norm, cfg.drop
    )


@register("task", "classification", ClassificationTaskConfig)
def build_classification(cfg: ClassificationTaskConfig, recipe: RecipeConfig) -> ClassificationTask:
    key = tokenizer_modality(recipe.model.tokenizers[cfg.tokenizer])
    num_classes = _num_classes(cfg, recipe)
    if num_classes is None:
        raise RecipeError(f"the classification head {cfg.head!r} has no num_classes")
    return ClassificationTask(cfg.tokenizer, cfg.head, num_classes, key, cfg.label_smoothing)


@register("head", "projection", ProjectionHeadConfig)
def build_projection(cfg: ProjectionHeadConfig, d_model: int, tokenizer) -> ProjectionHead:
    prefix = getattr(tokenizer, "num_prefix_tokens", 0)
    if cfg.pool == "cls" and prefix < 1:
        raise RecipeError(
            "a projection head with pool: cls needs a tokenizer with a class token; use mean or last"
        )
    return ProjectionHead(d_model, cfg.embed_dim, cfg.pool, prefix, cfg.norm)


def _check_captions(cfg, recipe: RecipeConfig) -> None:
    """A task's captions: read by a text tokenizer, no longer than its learned positions."""
    tok = recipe.model.tokenizers[cfg.caption_tokenizer]
    if tokenizer_modality(tok) != "text":
        raise RecipeError(f"caption_tokenizer {cfg.caption_tokenizer!r} must be a text tokenizer")
    bpe_len, data_len = getattr(tok, "max_len", None), getattr(cfg.data, "max_len", None)
    if bpe_len and data_len and data_len > bpe_len:
        raise RecipeError(
            f"data.max_len={data_len} exceeds the caption tokenizer's learned positions (max_len={bpe_len})"
        )


@register("task", "contrastive", ContrastiveTaskConfig)
def build_contrastive(cfg: ContrastiveTaskConfig, recipe: RecipeConfig) -> ContrastiveTask:
    m = recipe.model
    _check_captions(cfg, recipe)
    modality = tokenizer_modality(m.tokenizers[cfg.tokenizer])
    if modality == "text":
        raise RecipeError(
            f"tokenizer {cfg.tokenizer!r} reads text; a contrastive task pairs images or audio with text"
        )
    for key, head in (("head", cfg.head), ("caption_head", cfg.caption_head)):
        if m.heads[head].kind != "projection":
            raise RecipeError(
                f"tasks.<name>.{key} {head!r} is of kind {m.heads[head].kind}; a contrastive task needs "
                "kind: projection heads"
            )
    widths = {m.heads[h].embed_dim for h in (cfg.head, cfg.caption_head)}
    if len(widths) > 1:
        raise RecipeError(
            f"heads {cfg.head!r} and {cfg.caption_head!r} must share one embed_dim, got {sorted(widths)}"
        )
    prompts = None
    label_key = getattr(cfg.data, "label_key", None)
    if label_key:
        classes = read_class_prompts(resolve_root(cfg.data.root), label_key)
        texts = [(i, p) for i, ps in enumerate(classes.values()) for p in ps]
        tok = text_tokenizer(recipe, cfg.caption_tokenizer)
        ids, valid = tok.pad_batch(encode_captions(tok, [p for _, p in texts], cfg.data.max_len))
        prompts = (ids, valid, torch.tensor([i for i, _ in texts]))
    return ContrastiveTask(
        cfg.tokenizer,
        cfg.head,
        cfg.caption_tokenizer,
        cfg.caption_head,
        cfg.loss,
        modality,
        cfg.init_temperature,
        cfg.init_bias,
        cfg.learn_temperature,
        cfg.gather,
        prompts,
    )


@register("head", "projector", ProjectorHeadConfig)
def build_projector(cfg: ProjectorHeadConfig, d_model: tuple[int, int], tokenizer) -> ProjectorHead:
    """``d_model``: (the width of the tower it reads, the shared backbone's width)."""
    return ProjectorHead(*d_model, stack=cfg.stack, hidden=cfg.hidden)


@register("task", "prefix_lm", PrefixLMTaskConfig)
def build_prefix_lm(cfg: PrefixLMTaskConfig, recipe: RecipeConfig) -> PrefixLMTask:
    m = recipe.model
    _check_captions(cfg, recipe)
    modality = tokenizer_modality(m.tokenizers[cfg.tokenizer])
    if modality == "text" or m.tokenizers[cfg.tokenizer].kind == "dit":
        raise RecipeError(
            f"tokenizer {cfg.tokenizer!r} cannot be a prefix: a prefix_lm task reads images or audio"
        )
    if m.heads[cfg.caption_head].kind not in ("lm", "pretrained"):
        raise RecipeError(
            f"caption_head {cfg.caption_head!r} is of kind {m.heads[cfg.caption_head].kind}; a prefix_lm "
            "task needs an LM head (kind: lm or pretrained)"
        )
    if cfg.caption_tokenizer in m.towers:
        raise RecipeError(
            f"the text of a prefix_lm task runs through the shared backbone: drop model.towers.{cfg.caption_tokenizer}"
        )
    if m.backbone.kind != "pretrained" and not m.backbone.causal:
        raise RecipeError("a prefix_lm task generates text: set model.backbone.causal: true")
    if cfg.projector is not None:
        if m.heads[cfg.projector].kind != "projector":
            raise RecipeError(f"projector {cfg.projector!r} must be a model.heads entry of kind projector")
        if cfg.tokenizer not in m.towers:
            raise RecipeError(
                f"a projector maps a tower's output to the backbone: model.towers.{cfg.tokenizer} is missing"
            )
    data_len = getattr(cfg.data, "max_len", None)
    metric = cfg.main_metric or ("wer" if modality == "audio" else "exact_match")
    return PrefixLMTask(
        PrefixLM(cfg.tokenizer, cfg.caption_tokenizer, cfg.caption_head, cfg.projector),
        modality,
        text_tokenizer(recipe, cfg.caption_tokenizer),
        cfg.max_new_tokens or max(1, (data_len or 48) - 1),
        cfg.beam_size,
        cfg.length_penalty,
        (metric, "max" if metric == "exact_match" else "min"),
    )


@register("task", "seq2seq", Seq2SeqTaskConfig)
def build_seq2seq(cfg: Seq2SeqTaskConfig, recipe: RecipeConfig) -> Seq2SeqTask:
    m = recipe.model
    _check_captions(cfg, recipe)
    if m.tokenizers[cfg.tokenizer].kind == "dit":
        raise RecipeError(f"tokenizer {cfg.tokenizer!r} cannot be a source: it returns a conditioning vector")
    if cfg.tokenizer not in m.towers:
        raise RecipeError(
            f"a seq2seq task encodes its source with that tokenizer's own tower: add model.towers.{cfg.tokenizer} "
            "(the encoder; the shared model.backbone is the decoder)"
        )
    if cfg.caption_tokenizer in m.towers:
        raise RecipeError(
            f"the target text of a seq2seq task runs through the decoder (the shared backbone): drop "
            f"model.towers.{cfg.caption_tokenizer}"
        )
    if m.heads[cfg.caption_head].kind not in ("lm", "pretrained"):
        raise RecipeError(
            f"caption_head {cfg.caption_head!r} is of kind {m.heads[cfg.caption_head].kind}; a seq2seq task "
            "needs an LM head (kind: lm or pretrained)"
        )
    b = m.backbone
    if b.kind == "pretrained":
        raise RecipeError(
            "a seq2seq task's decoder is the shared backbone with cross-attention blocks; no pretrained "
            "backbone has them yet: use model.backbone: {block: cross, causal: true, …}"
        )
    if b.block != "cross" or not b.causal:
        raise RecipeError(
            "a seq2seq task's decoder is the shared backbone: set model.backbone.block: cross and causal: true"
        )
    tower = m.towers[cfg.tokenizer]
    d_tower, d_context = getattr(tower, "d_model", None), b.d_context or b.d_model
    if tower.kind != "pretrained" and d_tower != d_context:
        raise RecipeError(
            f"model.towers.{cfg.tokenizer} is {d_tower} wide but the decoder's cross-attention reads "
            f"{d_context}: set model.backbone.d_context: {d_tower}"
        )
    data_len = getattr(cfg.data, "max_len", None)
    metric = cfg.main_metric or (
        "wer" if tokenizer_modality(m.tokenizers[cfg.tokenizer]) == "audio" else "exact_match"
    )
    return Seq2SeqTask(
        EncoderDecoder(cfg.tokenizer, cfg.caption_tokenizer, cfg.caption_head),
        tokenizer_modality(m.tokenizers[cfg.tokenizer]),
        text_tokenizer(recipe, cfg.caption_tokenizer),
        cfg.max_new_tokens or max(1, (data_len or 48) - 1),
        cfg.beam_size,
        cfg.length_penalty,
        (metric, "max" if metric == "exact_match" else "min"),
    )


@register("dataset", "image_folder", ImageFolderDataConfig)
def build_image_folder(cfg: ImageFolderDataConfig, task, recipe: RecipeConfig):
    return image_folder_data(
        cfg, image_spec(recipe.model.tokenizers[task.tokenizer]), _num_classes(task, recipe)
    )


@register("dataset", "image_caption", ImageCaptionDataConfig)
def build_image_caption(cfg: ImageCaptionDataConfig, task, recipe: RecipeConfig):
    name = getattr(task, "caption_tokenizer", None)
    if name is None:
        raise RecipeError(
            "image_caption data is read by a task with a caption_tokenizer (kind: diffusion, contrastive "
            "prefix_lm or seq2seq)"
        )
    return image_caption_data(cfg, recipe.model.tokenizers[task.tokenizer], text_tokenizer(recipe, name))


@register("dataset", "audio_caption", AudioCaptionDataConfig)
def build_audio_caption(cfg: AudioCaptionDataConfig, task, recipe: RecipeConfig):
    name = getattr(task, "caption_tokenizer", None)
    if name is None:
        raise RecipeError(
            "audio_caption data is read by a task with a caption_tokenizer (kind: contrastive, prefix_lm or seq2seq)"
        )
    tok = recipe.model.tokenizers[task.tokenizer]
    if tokenizer_modality(tok) != "audio":
        raise RecipeError(f"audio_caption data needs an audio tokenizer; {task.tokenizer!r} is not one")
    return audio_caption_data(cfg, _audio_preprocess(tok), text_tokenizer(recipe, name))


@register("dataset", "shards", ShardsDataConfig)
def build_shards(cfg: ShardsDataConfig, task, recipe: RecipeConfig):
    from .data.audio import collate_audio
    from .data.collate import collate_classification
    from .data.image import _preprocess
    from .data.packed_shards import collate_text, packed_text_stream
    from .data.shards import audio_decoder, image_decoder, shards_data, text_decoder

    tok = recipe.model.tokenizers[task.tokenizer]
    if cfg.pack and task.kind not in ("causal_lm", "masked_lm"):
        raise RecipeError(
            f"data.pack packs text shards for causal_lm / masked_lm, not a {task.kind} task: remove it"
        )
    if cfg.label_key and not (task.kind == "contrastive" and tokenizer_modality(tok) == "image"):
        raise RecipeError(
            "data.label_key (zero-shot classes) applies to image_caption shards of a contrastive task"
        )
    packed = None
    if task.kind == "classification" and tokenizer_modality(tok) == "image":
        train, val = _preprocess(cfg, image_spec(tok))
        decoders = {"image": (image_decoder(train), image_decoder(val), collate_classification)}
    elif task.kind == "classification" and tokenizer_modality(tok) == "audio":
        train, val = _audio_preprocess(tok)
        decoders = {"audio": (audio_decoder(train), audio_decoder(val), collate_audio)}
    elif task.kind in ("causal_lm", "masked_lm"):
        text_tok = text_tokenizer(recipe, task.tokenizer)
        text = text_decoder(text_tok, cfg.seq_len)
        decoders = {"text": (text, text, collate_text)}
        if cfg.pack:
            packed = functools.partial(packed_text_stream, tokenizer=text_tok, seq_len=cfg.seq_len)
    elif task.kind in ("contrastive", "prefix_lm", "seq2seq"):
        decoders = _caption_shard_decoders(cfg, task, recipe)
    else:
        raise RecipeError(
            "data.kind: shards is read by classification (image, audio), causal_lm, masked_lm, contrastive, "
            f"prefix_lm and seq2seq tasks, not {task.kind}"
        )
    num_classes = _num_classes(task, recipe) if task.kind == "classification" else None
    return shards_data(cfg, task.kind, decoders, recipe.seed, num_classes, packed)


def _caption_shard_decoders(cfg: ShardsDataConfig, task, recipe: RecipeConfig) -> dict:
    """``{modality: (train decode, val decode, collate)}`` of the caption shards this task reads: the
    items and batches of ``image_caption`` / ``audio_caption`` data."""
    from .data.audio_caption import collate_audio_captions
    from .data.caption_shards import audio_caption_decoder, image_caption_decoder
    from .data.image_caption import collate_captions
    from .tokenizers.image import ImagePreprocess

    tok = recipe.model.tokenizers[task.tokenizer]
    captions = text_tokenizer(recipe, task.caption_tokenizer)
    if tokenizer_modality(tok) == "image":
        spec = image_spec(tok)
        classes = None
        if cfg.label_key:
            prompts = read_class_prompts(resolve_root(cfg.root), cfg.label_key)
            classes = {c: i for i, c in enumerate(prompts)}
        decode = image_caption_decoder(
            ImagePreprocess(spec.image_size, spec.in_chans), captions, cfg.max_len, cfg.label_key, classes
        )
        collate = functools.partial(collate_captions, pad_id=captions.pad_id)
        return {"image_caption": (decode, decode, collate)}
    if tokenizer_modality(tok) == "audio":
        train, val = _audio_preprocess(tok)
        collate = functools.partial(collate_audio_captions, pad_id=captions.pad_id)
        return {
            "audio_caption": (
                audio_caption_decoder(train, captions, cfg.max_len),
                audio_caption_decoder(val, captions, cfg.max_len),
                collate,
            )
        }
    raise RecipeError(
        f"caption shards pair images or audio with text; tokenizer {task.tokenizer!r} reads text"
    )


@register("dataset", "cifar10", CIFAR10DataConfig)
def build_cifar10(cfg: CIFAR10DataConfig, task, recipe: RecipeConfig):
    return cifar10_data(cfg, image_spec(recipe.model.tokenizers[task.tokenizer]), _num_classes(task, recipe))


_SOURCE_CONFIGS: dict[str, dict] = {}


def _source_config(source: str) -> dict:
    """The description of a pretrained source (pinned from a checkpoint, or read from the source once)."""
    pinned = _PINNED_PRETRAINED.get(source)
    if pinned:
        return pinned["config"]
    path = resolve_pretrained(source).resolve()
    key = str(path)
    if key not in _SOURCE_CONFIGS:  # a timm ViT is described from its config and file header alone
        timm = pretrained_family(source) == "timm_vit"
        _SOURCE_CONFIGS[key] = describe_timm_vit(path) if timm else _pretrained(source).config
    return _SOURCE_CONFIGS[key]


def _num_classes(task, recipe: RecipeConfig) -> int | None:
    """The classes a task's data must have: its head's, else its tokenizer's (a class-conditional DiT);
    a pretrained timm classifier has the checkpoint's unless the recipe gives ``num_classes``."""
    head = recipe.model.heads.get(getattr(task, "head", None))
    tok = recipe.model.tokenizers.get(getattr(task, "tokenizer", None))
    n = getattr(head, "num_classes", None) or getattr(tok, "num_classes", None)
    if n is None and head is not None and head.kind == "pretrained" and tokenizer_modality(tok) == "image":
        n = _source_config(head.source).get("num_classes") or None
    return n


def image_spec(tok_cfg):
    """What the data side needs of an image tokenizer's config (``image_size``, ``in_chans``): the
    config itself, or for a pretrained image encoder the recipe's overrides, else the checkpoint's."""
    if tok_cfg.kind != "pretrained":
        return tok_cfg
    config = _source_config(tok_cfg.source)
    h, w = config["image_size"]
    if tok_cfg.image_size is None and h != w:
        raise RecipeError(f"{tok_cfg.source} takes {h}×{w} images; set image_size for square ones")
    return SimpleNamespace(
        image_size=tok_cfg.image_size or h, in_chans=tok_cfg.in_chans or config["in_chans"]
    )


# --------------------------------------------------------------------------- composition
_TEXT_TOKENIZERS: dict[str, TextTokenizer] = {}


_PINNED_TEXT_TOKENIZERS: dict[str, TextTokenizer] = {}


def pin_text_tokenizers(tokenizers: dict[str, TextTokenizer]) -> None:
    """Use these BPEs (e.g. the ones a checkpoint carries) instead of loading or training them, so a
    resumed or re-evaluated run reads its data with exactly the tokenizer its weights were trained with."""
    _PINNED_TEXT_TOKENIZERS.clear()
    _PINNED_TEXT_TOKENIZERS.update(tokenizers)


def text_tokenizer(recipe: RecipeConfig, name: str) -> TextTokenizer:
    """The data-side BPE of ``model.tokenizers.<name>``: pinned (from a checkpoint), loaded from ``path``,
    or trained once on the training documents of the first task that reads it (cached as
    ``<corpus>/.cache/bpe-<vocab>-<hash of those documents>.json``)."""
    if name in _PINNED_TEXT_TOKENIZERS:
        return _PINNED_TEXT_TOKENIZERS[name]
    cfg = recipe.model.tokenizers[name]
    if cfg.kind == "pretrained":
        key = f"pretrained:{cfg.source}"
        if key not in _TEXT_TOKENIZERS:
            _TEXT_TOKENIZERS[key] = load_pretrained_tokenizer(cfg.source)
        return _TEXT_TOKENIZERS[key]
    if cfg.path:
        key = f"file:{cfg.path}"
        if key not in _TEXT_TOKENIZERS:
            _TEXT_TOKENIZERS[key] = TextTokenizer.from_file(cfg.path)
        return _TEXT_TOKENIZERS[key]
    task = next((t for t in recipe.tasks.values() if t.tokenizer == name and t.data.kind == "text"), None)
    captioned = next(
        (
            t
            for t in recipe.tasks.values()
            if getattr(t, "caption_tokenizer", None) == name
            and t.data.kind in ("image_caption", "audio_caption")
        ),
        None,
    )
    if task is None and captioned is None:
        raise RecipeError(
            f"'model.tokenizers.{name}' has no path and no text task to train it on: set its path "
            "to a tokenizer.json"
        )
    if task is not None:
        root = resolve_root(task.data.root)
        docs, train, _ = corpus_split(root, task.data.val_fraction, recipe.seed)
    else:  # the training captions of an image– or audio–caption task
        root = resolve_root(captioned.data.root)
        manifest = root / f"{captioned.data.train_split}.jsonl"
        if captioned.data.kind == "image_caption":
            docs = [c for _, c in read_captions(manifest)]
        else:
            docs = [str(r[captioned.data.text_key]) for r in manifest_rows(manifest, captioned.data.text_key)]
        train = range(len(docs))
    digest = hashlib.sha256()
    for i in train:  # the exact training documents decide the tokenizer
        digest.update(docs[i].encode("utf-8") + b"\0")
    masked = any(t.kind == "masked_lm" and t.tokenizer == name for t in recipe.tasks.values())
    key = f"bpe-{cfg.vocab_size}-{digest.hexdigest()[:16]}" + ("-mask" if masked else "")
    if key not in _TEXT_TOKENIZERS:
        path = (root if root.is_dir() else root.parent) / ".cache" / f"{key}.json"
        if path.is_file():
            _TEXT_TOKENIZERS[key] = TextTokenizer.from_file(path, {"mask": MASK_TOKEN} if masked else None)
        else:
            tok = TextTokenizer.train((docs[i] for i in train), vocab_size=cfg.vocab_size, mask=masked)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # atomic: ranks may race here
            tok.save(tmp)
            os.replace(tmp, path)
            _TEXT_TOKENIZERS[key] = tok
    return _TEXT_TOKENIZERS[key]


def build_model(
    recipe: RecipeConfig, text_tokenizers: dict[str, TextTokenizer] | None = None
) -> MultimodalModel:
    """The composed model. ``text_tokenizers`` (name → TextTokenizer) skips loading or training BPEs
    (e.g. the ones a checkpoint carries). Pretrained parts load their weights here; ``model.lora``
    then wraps the backbone's linear layers and freezes the tokenizers and backbone."""
    global _BUILD_SESSION
    m = recipe.model
    _BUILD_SESSION = {}
    try:
        backbone = lookup("backbone", m.backbone.kind).builder(m.backbone)
        towers = {n: lookup("backbone", c.kind).builder(c) for n, c in m.towers.items()}
        width = {n: (towers[n] if n in towers else backbone).d_model for n in m.tokenizers}
        tokenizers = {}
        for n, c in m.tokenizers.items():
            if c.kind == "bpe":
                tt = (text_tokenizers or {}).get(n) or text_tokenizer(recipe, n)
                tokenizers[n] = lookup("tokenizer", c.kind).builder(c, width[n], tt.vocab_size)
            else:
                tokenizers[n] = lookup("tokenizer", c.kind).builder(c, width[n])
        for n, r in m.resamplers.items():  # a fixed token budget for this tokenizer's inputs
            resampler = PerceiverResampler(width[n], r.num_latents, r.n_layers, r.n_heads, r.mlp_ratio)
            tokenizers[n] = ResampledTokenizer(tokenizers[n], resampler)
        heads = {}
        for name, cfg in m.heads.items():
            readers = [
                getattr(t, f"{prefix}tokenizer")
                for t in recipe.tasks.values()
                for prefix in ("", "caption_")
                if getattr(t, f"{prefix}head", None) == name
            ]
            tokenizer = tokenizers.get(readers[0]) if readers else None
            d = width[readers[0]] if readers else backbone.d_model
            if cfg.kind == "projector":  # a tower's width in, the shared backbone's out
                fed = [t.tokenizer for t in recipe.tasks.values() if getattr(t, "projector", None) == name]
                d = (width[fed[0]] if fed else backbone.d_model, backbone.d_model)
            heads[name] = lookup("head", cfg.kind).builder(cfg, d, tokenizer)
        loaded = {p.source: {"family": p.family, "config": p.config} for p in _BUILD_SESSION.values()}
        for p in _BUILD_SESSION.values():
            if (
                p.report is not None and p.report.loaded
            ):  # read from the source (not rebuilt from a checkpoint)
                print(p.report)
    finally:
        _BUILD_SESSION = None
    model = MultimodalModel(tokenizers, backbone, heads, towers)
    model.pretrained_configs = loaded  # checkpoints carry them, so they stand alone
    if m.lora is not None:  # the pretrained parts freeze; adapters and new parts train
        if m.backbone.kind != "pretrained":
            raise RecipeError(
                "'model.lora' adapts pretrained weights: set model.backbone to kind: pretrained"
            )
        _freeze(model.backbone)
        for table, parts in (("tokenizers", m.tokenizers), ("heads", m.heads)):
            for name, c in parts.items():
                if c.kind == "pretrained":
                    _freeze(getattr(model, table)[name])
        try:
            apply_lora(model, tuple(m.lora.targets), m.lora.rank, m.lora.alpha, m.lora.dropout, "backbone")
        except ValueError as e:
            raise RecipeError(f"'model.lora.targets': {e}") from None
    return model


def build_module(
    recipe: RecipeConfig,
    model: MultimodalModel | None = None,
    text_tokenizers: dict[str, TextTokenizer] | None = None,
) -> MultiTaskModule:
    """The LightningModule; checkpoints will carry the text tokenizers' JSON so they stand alone."""
    model = model or build_model(recipe, text_tokenizers)
    tasks = {n: lookup("task", t.kind).builder(t, recipe) for n, t in recipe.tasks.items()}
    weights = {n: t.weight for n, t in recipe.tasks.items()}
    module = MultiTaskModule(model, tasks, weights, recipe.optim, recipe_to_yaml(recipe), recipe.seed)
    module.pretrained_configs = dict(getattr(model, "pretrained_configs", {}))
    module.task_modalities = {
        n: tokenizer_modality(recipe.model.tokenizers[t.tokenizer]) for n, t in recipe.tasks.items()
    }
    module.tokenizer_files = {
        n: ((text_tokenizers or {}).get(n) or text_tokenizer(recipe, n)).to_json()
        for n, c in recipe.model.tokenizers.items()
        if tokenizer_modality(c) == "text"
    }
    return module


def build_datamodule(recipe: RecipeConfig) -> MultiTaskDataModule:
    """Resolves every task's data now (preparing missing bundled datasets, failing clearly on missing
    paths, naming the recipe key); each process builds its own datasets again in ``setup``.

    Raises ``DataError`` / ``DataNotFoundError`` prefixed with ``tasks.<name>.data``.
    """
    factories = {}
    for name, task in recipe.tasks.items():
        entry = lookup("dataset", task.data.kind)
        factories[name] = functools.partial(entry.builder, task.data, task, recipe)
    dm = MultiTaskDataModule(factories, seed=recipe.seed, multitask=recipe.multitask)
    for name, make in factories.items():
        try:
            dm.data[name] = make()
        except (DataNotFoundError, DataError, FileNotFoundError) as e:
            raise type(e)(f"tasks.{name}.data: {e.args[0] if e.args else e}") from None
    if len(dm.data) > 1 and recipe.multitask.check_leaks:
        check_no_leaks({n: (d.train_sources, d.val_sources) for n, d in dm.data.items()})
    return dm


def default_monitor(recipe: RecipeConfig, module: MultiTaskModule) -> tuple[str, str]:
    """The metric the best checkpoint tracks and its direction: ``checkpoint.monitor`` (checked against
    the metrics the tasks log), or the first task's main validation metric.

    Raises ``RecipeError`` (with a did-you-mean) for a monitor no task logs.
    """
    known = {"train/loss": "min"}
    for name, task in module.tasks.items():
        known[f"train/{name}/loss"] = "min"
        main_name, main_mode = getattr(task, "main_metric", ("loss", "min"))
        for metric in [*getattr(task, "val_metrics", {}), *getattr(task, "epoch_metric_names", ())]:
            known[f"val/{name}/{metric}"] = (
                main_mode
                if metric == main_name
                else ("min" if metric.endswith(("loss", "ppl", "wer", "cer")) else "max")
            )
    first = next(iter(recipe.tasks))
    metric, mode = getattr(module.tasks[first], "main_metric", ("loss", "min"))
    monitor = recipe.checkpoint.monitor or f"val/{first}/{metric}"
    if monitor not in known:
        close = difflib.get_close_matches(monitor, known, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise RecipeError(
            f"'checkpoint.monitor' is {monitor!r}, which no task logs.{hint} "
            f"Logged: {', '.join(sorted(known))}"
        )
    return monitor, recipe.checkpoint.mode or (mode if monitor == f"val/{first}/{metric}" else known[monitor])


def _pretrained_parts(recipe: RecipeConfig):
    """``module → [modules of kind pretrained: tokenizers, towers, backbone]`` for ``optim.freeze_pretrained_epochs``
    (heads are left training: a new classifier is what the frozen stage trains).
    Raises ``RecipeError`` when nothing is pretrained or DDP would see unused parameters."""
    m = recipe.model
    names = [n for n, c in m.tokenizers.items() if c.kind == "pretrained"]
    towers = [n for n, c in m.towers.items() if c.kind == "pretrained"]
    if not names and not towers and m.backbone.kind != "pretrained":
        raise RecipeError(
            "optim.freeze_pretrained_epochs freezes parts of kind pretrained; this model has none"
        )
    if recipe.trainer.strategy not in ("auto", "ddp", "ddp_find_unused_parameters_true", "fsdp2"):
        raise RecipeError(
            f"optim.freeze_pretrained_epochs works with DDP, FSDP2 or one device, not trainer.strategy="
            f"{recipe.trainer.strategy!r}"
        )

    def parts(pl_module):
        model = pl_module.model
        return (
            [model.tokenizers[n] for n in names]
            + [model.towers[n] for n in towers]
            + ([model.backbone] if m.backbone.kind == "pretrained" else [])
        )

    return parts


def build_strategy(t, unused: bool = False, sharded: bool = False):
    """``trainer.strategy`` as Lightning takes it: ``fsdp2`` → ``FSDP2Strategy`` (``sharded``: each rank
    saves its own shard); ``ddp`` told about parameters that some steps leave without gradient
    (``unused``); other names unchanged."""
    if t.strategy == "fsdp2":
        return FSDP2Strategy(sharded=sharded)
    if unused and t.strategy == "ddp":
        return "ddp_find_unused_parameters_true"
    return t.strategy


def build_trainer(recipe: RecipeConfig, run: Run, module: MultiTaskModule, extra_callbacks=()) -> L.Trainer:
    monitor, mode = default_monitor(recipe, module)
    ck = recipe.checkpoint
    checkpoint = ModelCheckpoint(
        dirpath=str(run.checkpoints),
        filename="best-epoch{epoch:03d}-step{step:06d}",
        monitor=monitor,
        mode=mode,
        save_top_k=ck.save_top_k,
        save_last=False,  # LastCheckpoint keeps last.ckpt fresh
        auto_insert_metric_name=False,  # validation only: a step-triggered save would carry a stale score
    )
    last = [LastCheckpoint(str(run.checkpoints), ck.every_n_train_steps)] if ck.save_last else []
    # after the checkpoint callbacks: a stop on a signal keeps the best / last checkpoints of its step
    stop = StopOnSignal(last[0] if last else None)
    # Redrawn every step on a terminal; into a log file, a line every 20 steps is plenty.
    progress = (
        [TQDMProgressBar(refresh_rate=1 if sys.stderr.isatty() else 20)]
        if recipe.trainer.enable_progress_bar
        else []
    )
    ema = []
    if recipe.optim.ema_decay is not None:  # under FSDP2 each rank averages its own shard
        sharded_ema = recipe.trainer.strategy == "fsdp2"
        ema = [(ShardedEMAWeights if sharded_ema else EMAWeights)(recipe.optim.ema_decay)]
    freeze = []
    if recipe.optim.freeze_pretrained_epochs:
        freeze = [FreezePretrained(recipe.optim.freeze_pretrained_epochs, _pretrained_parts(recipe))]
    loggers = build_loggers(
        recipe.logger, run.dir, f"{recipe.name}/{run.run_id}", run.wandb_id, recipe_to_dict(recipe)
    )
    t = recipe.trainer
    # frozen parameters, or the parts of the tasks a sampled step does not train, get no gradient:
    # DDP must be told (find_unused_parameters), or it waits for them forever
    unused = bool(freeze) or (recipe.multitask.schedule == "sampled" and len(recipe.tasks) > 1)
    strategy = build_strategy(t, unused, sharded=recipe.checkpoint.sharded)
    module.compile_blocks, module.checkpoint_blocks = t.compile, t.activation_checkpointing
    trainer = L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=strategy,
        num_nodes=t.num_nodes,
        precision=t.precision,
        max_epochs=t.max_epochs,
        max_steps=t.max_steps,
        max_time=t.max_time,
        gradient_clip_val=t.gradient_clip_val,
        gradient_clip_algorithm=t.gradient_clip_algorithm,
        accumulate_grad_batches=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every_n_steps,
        val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=t.check_val_every_n_epoch,
        limit_train_batches=t.limit_train_batches,
        limit_val_batches=t.limit_val_batches,
        num_sanity_val_steps=t.num_sanity_val_steps,
        deterministic=t.deterministic,
        enable_progress_bar=t.enable_progress_bar,
        enable_model_summary=False,  # the CLI prints parameters and FLOPs per sample instead
        inference_mode=False,  # no_grad: metric states stay usable when validate_first runs before fit
        default_root_dir=str(run.dir),
        use_distributed_sampler=False,  # the datamodule shards itself (no padded evaluation)
        logger=loggers,
        callbacks=[
            RunFolder(run, recipe_to_yaml(recipe)),
            checkpoint,
            *last,
            stop,
            ThroughputLogger(),
            BadSampleReport(),
            TextSamples(),
            AudioSamples(),
            DecodedSamples(),
            DiffusionSamples(),
            *ema,
            *freeze,
            *progress,
            *extra_callbacks,
        ],
        plugins=[AtomicCheckpointIO()],
    )
    if unused and isinstance(trainer.strategy, DDPStrategy):  # also when "auto" chose DDP
        trainer.strategy._ddp_kwargs["find_unused_parameters"] = True
    return trainer


def pin_checkpoint(ckpt: dict | None) -> None:
    """Build from what a checkpoint carries — its text tokenizers and its pretrained architectures —
    until called again with ``None``."""
    state = (ckpt or {}).get("mmformer", {})
    pin_text_tokenizers({n: TextTokenizer.from_json(j) for n, j in state.get("tokenizers", {}).items()})
    pin_pretrained(state.get("pretrained", {}))
