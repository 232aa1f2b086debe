"""A training checkpoint as one value: its contents, its recipe, and the ``BuildContext`` that rebuilds
what its weights were trained with (its text tokenizers, its pretrained architectures). The one loader
that ``validate``, ``generate``, ``sample``, ``export`` and the evaluation helpers share."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ..components import BuildContext
from ..errors import RecipeError
from ..recipe import RecipeConfig, recipe_from_yaml
from ..tasks import MultiTaskModule
from ..training.checkpoint_io import NOT_MMFORMER, carries_recipe
from ..training.sharded import is_sharded, read_checkpoint
from .model import build_module


@dataclass
class LoadedCheckpoint:
    path: Path
    state: dict[str, Any]  # what torch.load gives (a sharded folder merged), weights_only
    recipe: RecipeConfig
    context: BuildContext

    def task(self, kind: str) -> str:
        """The name of the first task of ``kind``; ``RecipeError`` naming the tasks there are otherwise."""
        name = next((n for n, t in self.recipe.tasks.items() if t.kind == kind), None)
        if name is None:
            kinds = sorted({t.kind for t in self.recipe.tasks.values()})
            raise RecipeError(f"{self.path} has no {kind} task (its tasks are {', '.join(kinds)})")
        return name

    def module(self) -> MultiTaskModule:
        """The LightningModule holding the checkpoint's weights (EMA weights when the run kept them); a
        new one at every call (its own build context: no modules shared with an earlier call)."""
        module = build_module(self.recipe, ctx=BuildContext.from_checkpoint(self.recipe, self.state))
        try:
            module.load_state_dict(self.state["state_dict"])
        except RuntimeError as e:  # the recipe, overridden, builds another model than the one trained
            lines = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
            raise RecipeError(
                f"{self.path}: its weights do not fit the model its recipe builds with these overrides "
                f"({lines[0] if lines else e}); an override that changes the model's parameters (sizes, "
                "kernel options such as max_len, a kernel with parameters of its own) cannot apply to "
                "trained weights"
            ) from None
        return module


def load_checkpoint(path: str | Path, overrides=()) -> LoadedCheckpoint:
    """Read an mmformer training checkpoint (a file, or a sharded folder merged here) and its recipe
    (:func:`stored_recipe`, with ``key=value`` ``overrides``).

    Raises:
        FileNotFoundError: a missing path.
        CheckpointError: an empty, truncated, foreign or unsafe (pickled code) file.
        RecipeError: a PyTorch checkpoint that is not an mmformer training checkpoint (no recipe).
    """
    path = Path(path)
    if not (path.is_file() or is_sharded(path)):
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    state = read_checkpoint(path)
    if not carries_recipe(state):
        raise RecipeError(f"{path} {NOT_MMFORMER}")
    recipe = stored_recipe(state["mmformer"]["recipe_yaml"], overrides)
    return LoadedCheckpoint(path, state, recipe, BuildContext.from_checkpoint(recipe, state))


def stored_recipe(text: str, overrides=()) -> RecipeConfig:
    """The recipe a checkpoint carries, read as written. It was resolved when the run started, so a
    ``${…}`` still in one of its strings is text (written escaped, or a caption), not an interpolation
    to resolve again: ``${oc.env:…}`` would read this machine's environment, or fail where the variable
    is unset. The ``overrides`` are the caller's own and resolve as usual.

    Raises ``RecipeError`` as :func:`recipe_from_yaml` does."""
    literals: dict[str, str] = {}

    def hide(value: str) -> str:  # a placeholder OmegaConf leaves alone, put back once the recipe is built
        if "${" not in value:
            return value
        literals[key := f"<mmformer literal {len(literals)}>"] = value
        return key

    data = _map_strings(OmegaConf.to_container(OmegaConf.create(text)), hide)
    recipe = recipe_from_yaml(OmegaConf.to_yaml(OmegaConf.create(data)), overrides)
    return _put_back(recipe, literals) if literals else recipe


def _map_strings(node, fn):
    if isinstance(node, str):
        return fn(node)
    if isinstance(node, dict):
        return {k: _map_strings(v, fn) for k, v in node.items()}
    if isinstance(node, list):
        return [_map_strings(v, fn) for v in node]
    return node


def _put_back(node, literals: dict[str, str]):
    """``node`` (the built recipe: dataclasses, dicts, lists) with every placeholder string replaced by
    the text it stands for, in place."""
    if isinstance(node, str):
        return literals.get(node, node)
    if isinstance(node, dict):
        return {k: _put_back(v, literals) for k, v in node.items()}
    if isinstance(node, (list, tuple)) and type(node) in (list, tuple):
        return type(node)(_put_back(v, literals) for v in node)
    if is_dataclass(node) and not isinstance(node, type):
        for f in fields(node):
            object.__setattr__(node, f.name, _put_back(getattr(node, f.name), literals))
    return node
