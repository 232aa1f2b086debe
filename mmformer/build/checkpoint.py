"""A training checkpoint as one value: its contents, its recipe, and the ``BuildContext`` that rebuilds
what its weights were trained with (its text tokenizers, its pretrained architectures). The one loader
that ``validate``, ``generate``, ``sample``, ``export`` and the evaluation helpers share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..components import BuildContext
from ..errors import RecipeError
from ..recipe import RecipeConfig, recipe_from_yaml
from ..tasks import MultiTaskModule
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
        module.load_state_dict(self.state["state_dict"])
        return module


def load_checkpoint(path: str | Path, overrides=()) -> LoadedCheckpoint:
    """Read an mmformer training checkpoint (a file, or a sharded folder merged here) and its recipe
    (with ``key=value`` ``overrides``). Raises ``FileNotFoundError`` for a missing path and
    ``RecipeError`` for a file that is not an mmformer training checkpoint."""
    path = Path(path)
    if not (path.is_file() or is_sharded(path)):
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    state = read_checkpoint(path)
    if "recipe_yaml" not in state.get("mmformer", {}):
        raise RecipeError(f"{path} is not an mmformer training checkpoint (it carries no recipe)")
    recipe = recipe_from_yaml(state["mmformer"]["recipe_yaml"], overrides)
    return LoadedCheckpoint(path, state, recipe, BuildContext.from_checkpoint(recipe, state))
