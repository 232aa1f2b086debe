"""Tokenizer kind ``vq``: images → discrete codes of a VQ-VAE (``mmformer.tokenizers.vq``) → ``Tokens``.

Without ``checkpoint`` the codec is built from the sizes here and trained by a ``vq`` task of the same
recipe (``mmformer.components.tasks.vq``); with ``checkpoint: PATH`` (the ``.ckpt`` of such a run) it is
loaded frozen, its architecture read from that checkpoint, and ``image_size`` / ``in_chans`` /
``codebook_size`` here must match it (the data side reads images at this ``image_size``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from ..errors import RecipeError, SourceNotFoundError, positive
from ..registry import register
from ..tokenizers.vq import VQVAE, VQTokenizer, load_vq
from .context import BuildContext


@dataclass
class VQTokenizerConfig:
    """``model.tokenizers.<name>`` of kind ``vq``: a VQ-VAE image codec (van den Oord et al. 2017) with a
    factorised, L2-normalised codebook (ViT-VQGAN §3.2) and dead-code restarts; its code ids are embedded
    (``d_model`` wide, learned 2-D grid positions) when a non-``vq`` task reads it."""

    modality: ClassVar[str] = "image"
    kind: str = "vq"
    image_size: int = 28  # square side in pixels; the code grid is image_size / 2**len(channels)
    in_chans: int = 1
    channels: list[int] = field(default_factory=lambda: [32, 64])  # widths of the stride-2 levels
    num_res_blocks: int = 1
    d_latent: int = 32  # encoder output / decoder input width
    codebook_size: int = 512
    code_dim: int = 8  # the normalised lookup space (ViT-VQGAN: 8–32)
    restart_after: int = 100  # training steps a code may go unchosen before its restart (0 = never)
    checkpoint: Optional[str] = None  # a trained vq run's .ckpt: load its codec, frozen

    def __post_init__(self) -> None:
        positive(self, "image_size", "num_res_blocks", "d_latent", "codebook_size", "code_dim")
        if self.in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 (grayscale) or 3 (RGB), got {self.in_chans}")
        if not self.channels or min(self.channels) < 1:
            raise ValueError(f"channels must be positive widths, got {list(self.channels)}")
        if self.restart_after < 0:
            raise ValueError(f"restart_after must be >= 0, got {self.restart_after}")
        factor = 2 ** len(self.channels)
        if self.image_size % factor:
            raise ValueError(
                f"image_size={self.image_size} is not divisible by 2**len(channels)={factor} "
                f"({len(self.channels)} stride-2 levels)"
            )

    def check(self, recipe, where: str) -> None:
        name = where.rsplit(".", 1)[1]
        trained_by = [n for n, t in recipe.tasks.items() if t.kind == "vq" and t.tokenizer == name]
        if self.checkpoint is None and not trained_by:
            raise RecipeError(
                f"'{where}' has no checkpoint and no vq task trains it: set {where}.checkpoint to a trained "
                "vq run's .ckpt (recipes/image/vq_mnist5k.yaml makes one) or add a task of kind vq"
            )
        if self.checkpoint is not None and trained_by:
            raise RecipeError(
                f"'{where}.checkpoint' loads a frozen codec, which task {trained_by[0]!r} (kind vq) cannot "
                "train: remove the checkpoint to train a new codec"
            )


@register("tokenizer", "vq", VQTokenizerConfig)
def build_vq_tokenizer(cfg: VQTokenizerConfig, d_model: int, ctx: BuildContext, name: str) -> VQTokenizer:
    where = f"model.tokenizers.{name}.checkpoint"
    if cfg.checkpoint is None:
        args = ("image_size", "in_chans", "num_res_blocks", "d_latent", "codebook_size", "code_dim")
        vq = VQVAE(
            channels=tuple(cfg.channels),
            restart_after=cfg.restart_after,
            **{k: getattr(cfg, k) for k in args},
        )
        return VQTokenizer(vq, d_model)
    try:
        vq = load_vq(
            cfg.checkpoint, image_size=cfg.image_size, in_chans=cfg.in_chans, codebook_size=cfg.codebook_size
        )
    except FileNotFoundError as e:
        raise RecipeError(
            f"'{where}': {e} (train one with recipes/image/vq_mnist5k.yaml or vq_emoji.yaml)"
        ) from None
    except ValueError as e:
        raise RecipeError(f"'{where}': {e}") from None
    return VQTokenizer(vq, d_model)


def load_frozen_codec(cfg, name: str) -> VQVAE:
    """The frozen codec ``model.tokenizers.<name>`` reads (kinds ``vq_codes`` and ``chameleon``):
    ``cfg.checkpoint`` (a trained ``vq`` run's ``.ckpt``) loaded by ``mmformer.tokenizers.vq.load_vq``,
    checked against the recipe's ``cfg.image_size`` / ``cfg.in_chans`` / ``cfg.codebook_size`` (None:
    whatever the codec has). Raises ``SourceNotFoundError`` for a missing file (the CLI adds the recipe
    header's ``# Source:`` steps that make it) and ``RecipeError`` for a codec of other sizes than the
    recipe's (both named)."""
    try:
        return load_vq(
            cfg.checkpoint, image_size=cfg.image_size, in_chans=cfg.in_chans, codebook_size=cfg.codebook_size
        )
    except FileNotFoundError:
        raise SourceNotFoundError(
            f"'model.tokenizers.{name}.checkpoint': {cfg.checkpoint!r} does not exist", cfg.checkpoint
        ) from None
    except ValueError as e:
        raise RecipeError(f"'model.tokenizers.{name}': {e}") from None
