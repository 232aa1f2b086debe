"""The config rules of the image tasks that may read captions beside their images (kinds ``diffusion``,
``maskgit``, ``vq``): ``caption_tokenizer`` is None (class labels or nothing) or a text tokenizer."""

from __future__ import annotations

from ...errors import RecipeError
from ..tokenizers import modality_at_load
from .base import TaskConfigParts


class OptionalCaptionParts(TaskConfigParts):
    """A task on ``tokenizer``'s images whose ``caption_tokenizer`` (text) is optional: it is one of the
    task's tokenizers only when set."""

    def tokenizer_refs(self) -> dict[str, str]:
        refs = {"tokenizer": self.tokenizer}
        if self.caption_tokenizer is not None:
            refs["caption_tokenizer"] = self.caption_tokenizer
        return refs


def check_caption_tokenizer(cfg, recipe, where: str) -> None:
    """``cfg.caption_tokenizer``, when set, must name a text tokenizer of ``recipe.model.tokenizers``;
    raises ``RecipeError`` naming ``<where>.caption_tokenizer`` otherwise."""
    if cfg.caption_tokenizer is None:
        return
    if modality_at_load(recipe.model.tokenizers[cfg.caption_tokenizer]) not in ("text", None):
        raise RecipeError(f"'{where}.caption_tokenizer' {cfg.caption_tokenizer!r} must be a text tokenizer")
