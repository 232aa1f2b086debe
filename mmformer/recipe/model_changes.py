"""Whether a run folder trained the model a recipe describes: what ``resume=auto`` asks before it
continues a run of the same recipe name (``training.runs.find_latest_resumable``)."""

from __future__ import annotations

import yaml

from .loading import recipe_from_yaml, recipe_to_dict
from .sections import RecipeConfig

# keys that change how a model computes or regularises, never its function or its weights
RUNTIME_KEYS = frozenset({"sdpa_backend", "ff_chunks", "drop", "attn_drop", "proj_drop", "drop_path"})
# the softmax kernels compute one function (tested equal): switching among them keeps the model
SOFTMAX_KERNELS = frozenset({"auto", "eager", "sdpa", "flex"})


def model_changes(saved_yaml: str, recipe: RecipeConfig) -> list[str]:
    """``model.KEY: old → new`` for every ``model.*`` leaf where ``recipe`` describes another model than
    ``saved_yaml`` (a run's recipe as written in its folder). The saved recipe is loaded as this
    mmformer loads it, so keys a newer version added compare at their defaults, and entries of free-form
    maps (``kernel_options``, tokenizers, heads) count both ways; a saved recipe this version cannot load
    is compared as written, on the keys it has. Not counted: ``RUNTIME_KEYS`` and switches among the
    softmax kernels."""
    try:
        old = _leaves(recipe_to_dict(recipe_from_yaml(saved_yaml))["model"], "model.")
        keys = None
    except Exception:  # noqa: BLE001 - an older schema: compare what it wrote
        old = _leaves((yaml.safe_load(saved_yaml) or {}).get("model") or {}, "model.")
        keys = set(old)
    new = _leaves(recipe_to_dict(recipe)["model"], "model.")
    changes = []
    for key in sorted(keys if keys is not None else set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        leaf = key.rsplit(".", 1)[-1]
        if a == b or leaf in RUNTIME_KEYS or (leaf == "attn_kernel" and {a, b} <= SOFTMAX_KERNELS):
            continue
        changes.append(f"{key}: {a!r} → {b!r}")
    return changes


def _leaves(tree: dict, prefix: str) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
