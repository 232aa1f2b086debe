"""The built-in components, one file per kind or family: each holds its config dataclasses, their rules
across the recipe (``check``), its builders and their registration (``mmformer.registry``), side by side.
Importing this package registers them all. A new kind is one new file here plus its line below; a
user's own component registers the same way from its own module."""

from . import backbones, datasets, heads, pair_classifier, tasks, token_ids, tokenizers, vq  # noqa: F401
from .context import BuildContext

__all__ = ["BuildContext"]
