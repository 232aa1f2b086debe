"""The data side of the composition root: every task's data from a loaded recipe."""

from __future__ import annotations

import functools

from ..components import BuildContext
from ..data.datamodule import MultiTaskDataModule
from ..data.leaks import check_no_leaks
from ..data.roots import DataError, DataNotFoundError
from ..registry import lookup


def build_datamodule(recipe, ctx: BuildContext | None = None) -> MultiTaskDataModule:
    """Resolves every task's data now (preparing missing bundled datasets, failing clearly on missing
    paths, naming the recipe key); each process builds its own datasets again in ``setup``.

    Raises ``DataError`` / ``DataNotFoundError`` prefixed with ``tasks.<name>.data``.
    """
    ctx = ctx or BuildContext(recipe)
    factories = {}
    for name, task in recipe.tasks.items():
        entry = lookup("dataset", task.data.kind)
        factories[name] = functools.partial(entry.builder, task.data, task, ctx)
    dm = MultiTaskDataModule(factories, seed=recipe.seed, multitask=recipe.multitask)
    for name, make in factories.items():
        try:
            dm.data[name] = make()
        except (DataNotFoundError, DataError, FileNotFoundError) as e:
            raise type(e)(f"tasks.{name}.data: {e.args[0] if e.args else e}") from None
    if len(dm.data) > 1 and recipe.multitask.check_leaks:
        check_no_leaks({n: (d.train_sources, d.val_sources) for n, d in dm.data.items()})
    return dm
