"""Head kinds — each reads hidden states ``(B, N, D)`` and returns a task's outputs
(``mmformer.models.heads``): ``classifier``, ``projection`` (contrastive embeddings), ``projector`` (a
tower's tokens → the backbone's width, LLaVA), ``lm`` and ``mlm`` (vocabulary logits), ``dit`` (DiT's
final layer) and ``pretrained`` (the head real pretrained weights carry)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from ..errors import RecipeError, positive, probability
from ..models import ClassifierHead
from ..models.heads import DiTFinalLayer, LMHead, MLMHead, ProjectionHead, ProjectorHead
from ..models.pretrained.timm_vit import adapt_classifier
from ..registry import register
from ..tokenizers.diffusion import DiTTokenizer
from ..tokenizers.text import TextEmbedding
from .context import BuildContext
from .tokenizers import modality_at_load, timm_report


def readers(recipe, where: str) -> list[str]:
    """The tokenizers whose tokens reach the head at ``where`` (``model.heads.<name>``), over all tasks."""
    name = where.rsplit(".", 1)[-1]
    return [tok for t in recipe.tasks.values() for head, tok in t.head_refs().values() if head == name]


def _check_text_reader(recipe, where: str, kind: str) -> None:
    for tok in readers(recipe, where):
        if modality_at_load(recipe.model.tokenizers[tok]) not in ("text", None):
            raise RecipeError(f"'{where}': an '{kind}' head needs a task whose tokenizer is a text tokenizer")


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
        positive(self, "num_classes")
        probability(self, "drop")


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
        positive(self, "embed_dim")


@dataclass
class ProjectorHeadConfig:
    """``model.heads.<name>`` of kind ``projector``: an encoder tower's tokens → the backbone's width, the
    prefix of a ``prefix_lm`` task that names it as ``projector`` (``mmformer.models.heads.ProjectorHead``,
    LLaVA's two-layer MLP after stacking ``stack`` consecutive tokens)."""

    kind: str = "projector"
    stack: int = 1
    hidden: Optional[int] = None  # default: the backbone's d_model

    def __post_init__(self) -> None:
        positive(self, "stack", "hidden")


@dataclass
class LMHeadConfig:
    """``model.heads.<name>`` of kind ``lm``: next-token logits over the text tokenizer's vocabulary."""

    kind: str = "lm"
    tie_weights: bool = True  # share the token-embedding matrix

    def check(self, recipe, where: str) -> None:
        _check_text_reader(recipe, where, "lm")


@dataclass
class MLMHeadConfig:
    """``model.heads.<name>`` of kind ``mlm``: BERT's masked-LM head (dense, GELU, LayerNorm, decoder over
    the vocabulary with a bias; ``mmformer.models.heads.MLMHead``)."""

    kind: str = "mlm"
    tie_weights: bool = True  # the decoder shares the token-embedding matrix

    def check(self, recipe, where: str) -> None:
        _check_text_reader(recipe, where, "mlm")


@dataclass
class DiTHeadConfig:
    """``model.heads.<name>`` of kind ``dit``: DiT's adaLN final layer + unpatchify back to an image; with
    ``learn_sigma`` it also predicts the variance (twice the channels; Nichol & Dhariwal 2021)."""

    kind: str = "dit"
    learn_sigma: bool = False

    def check(self, recipe, where: str) -> None:
        if any(recipe.model.tokenizers[t].kind != "dit" for t in readers(recipe, where)):
            raise RecipeError(
                f"'{where}': a 'dit' head needs a diffusion task whose tokenizer is of kind dit"
            )


@dataclass
class PretrainedHeadConfig:
    """``model.heads.<name>`` of kind ``pretrained``: the head the weights carry (``lm`` of a Llama,
    ``embedding`` — mean pool + L2 — of a sentence encoder, the classifier of a timm ViT, replaced by a
    new zero-initialised one when ``num_classes`` differs from the checkpoint's)."""

    kind: str = "pretrained"
    source: str = MISSING
    num_classes: Optional[int] = None  # timm ViT: a new classifier for this many classes

    def __post_init__(self) -> None:
        positive(self, "num_classes")


@register("head", "classifier", ClassifierHeadConfig)
def build_classifier(cfg: ClassifierHeadConfig, d_model: int, tokenizer, ctx: BuildContext) -> ClassifierHead:
    return ClassifierHead(
        d_model, cfg.num_classes, cfg.pool, getattr(tokenizer, "num_prefix_tokens", 0), cfg.fc_norm, cfg.drop
    )


@register("head", "projection", ProjectionHeadConfig)
def build_projection(cfg: ProjectionHeadConfig, d_model: int, tokenizer, ctx: BuildContext) -> ProjectionHead:
    prefix = getattr(tokenizer, "num_prefix_tokens", 0)
    if cfg.pool == "cls" and prefix < 1:
        raise RecipeError(
            "a projection head with pool: cls needs a tokenizer with a class token; use mean or last"
        )
    return ProjectionHead(d_model, cfg.embed_dim, cfg.pool, prefix, cfg.norm)


@register("head", "projector", ProjectorHeadConfig)
def build_projector(cfg: ProjectorHeadConfig, d_model: int, tokenizer, ctx: BuildContext) -> ProjectorHead:
    """``d_model``: the width of the tower it reads; it maps to the shared backbone's (``ctx.d_model``)."""
    return ProjectorHead(d_model, ctx.d_model, stack=cfg.stack, hidden=cfg.hidden)


def _vocabulary_head(cls, kind: str, cfg, d_model: int, tokenizer):
    """An ``lm`` / ``mlm`` head over the text tokenizer's vocabulary, tied to its embedding when asked."""
    if not isinstance(tokenizer, TextEmbedding):
        raise RecipeError(f"an '{kind}' head needs a task whose tokenizer is a text tokenizer")
    head = cls(d_model, tokenizer.vocab_size)
    if cfg.tie_weights:
        head.tie_to(tokenizer.embed)
    return head


@register("head", "lm", LMHeadConfig)
def build_lm_head(cfg: LMHeadConfig, d_model: int, tokenizer, ctx: BuildContext) -> LMHead:
    return _vocabulary_head(LMHead, "lm", cfg, d_model, tokenizer)


@register("head", "mlm", MLMHeadConfig)
def build_mlm_head(cfg: MLMHeadConfig, d_model: int, tokenizer, ctx: BuildContext) -> MLMHead:
    return _vocabulary_head(MLMHead, "mlm", cfg, d_model, tokenizer)


@register("head", "dit", DiTHeadConfig)
def build_dit_head(cfg: DiTHeadConfig, d_model: int, tokenizer, ctx: BuildContext) -> DiTFinalLayer:
    if not isinstance(tokenizer, DiTTokenizer):
        raise RecipeError("a 'dit' head needs a diffusion task whose tokenizer is of kind dit")
    out_chans = tokenizer.in_chans * (2 if cfg.learn_sigma else 1)
    return DiTFinalLayer(d_model, tokenizer.patch_size, tokenizer.grid_size, out_chans)


def _timm_classifier(cfg: PretrainedHeadConfig, head, report):
    """A timm ViT's classifier (``head.*`` or ``head.fc.*``), or a new zero-initialised one for
    ``num_classes`` (also when the file has none: a feature-extractor export). Raises ``RecipeError``
    naming the file's ``head*`` keys when it has no classifier and ``num_classes`` is not set."""
    if head.num_classes == 0 and cfg.num_classes is None:
        seen = (
            f"head-like keys in the file: {', '.join(report.head_keys)}; mmformer reads a classifier from "
            "head.weight/bias or head.fc.weight/bias alone"
            if report.head_keys
            else "no head.* keys in the file"
        )
        raise RecipeError(
            f"{cfg.source} carries no classifier to reuse ({seen}): set num_classes for a new "
            "zero-initialised one, or add a new head (e.g. kind: classifier)"
        )
    return adapt_classifier(head, cfg.num_classes or head.num_classes, report)


@register("head", "pretrained", PretrainedHeadConfig)
def build_pretrained_head(cfg: PretrainedHeadConfig, d_model: int, tokenizer, ctx: BuildContext):
    pretrained = ctx.pretrained(cfg.source)
    heads = list(pretrained.model.heads.values())
    if pretrained.family == "timm_vit":
        return _timm_classifier(cfg, heads[0], timm_report(pretrained))
    if len(heads) != 1:
        raise RecipeError(f"{cfg.source} carries no head to reuse; add a new head (e.g. kind: classifier)")
    if cfg.num_classes is not None:
        raise RecipeError(f"num_classes applies to a timm ViT's classifier; {cfg.source} is not one")
    if tokenizer is not None and tokenizer not in pretrained.model.tokenizers.values():
        raise RecipeError(
            f"a pretrained head of {cfg.source} reads its own vocabulary: the task's tokenizer must be "
            f"{{kind: pretrained, source: {cfg.source}}} too"
        )
    return heads[0]
