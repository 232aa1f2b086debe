"""Kind → (config dataclass, builder) tables: a leaf that imports nothing of mmformer.

Importing ``mmformer.components`` registers the built-in kinds (one file per kind or family there).
Users add their own the same way, from any module imported before the recipe is loaded::

    from dataclasses import dataclass
    from mmformer.registry import register

    @dataclass
    class MyHeadConfig:
        kind: str = "my_head"
        num_classes: int = 10

    @register("head", "my_head", MyHeadConfig)
    def build_my_head(cfg: MyHeadConfig, d_model: int, tokenizer, ctx) -> nn.Module: ...

A recipe then selects it with ``kind: my_head`` and its keys are validated against ``MyHeadConfig``.
Builder signatures by group (``ctx``: the ``mmformer.components.context.BuildContext`` of the build):

- ``backbone``: ``(cfg, ctx) -> Backbone``
- ``tokenizer``: ``(cfg, d_model, ctx, name) -> nn.Module`` returning ``Tokens``
- ``head``: ``(cfg, d_model, tokenizer, ctx) -> nn.Module`` (``tokenizer``: the module whose tokens it reads)
- ``task``: ``(cfg, ctx) -> Task`` (the recipe is ``ctx.recipe``)
- ``dataset``: ``(cfg, task_cfg, ctx) -> TaskData``

A config may define ``check(recipe, where)`` (:class:`CrossChecked`): the rules that involve other parts
of the recipe, run when the recipe loads. A task config names the model parts it uses
(:class:`TaskParts`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, is_dataclass
from typing import Any, Protocol, runtime_checkable

GROUPS = ("tokenizer", "backbone", "head", "task", "dataset")


@dataclass(frozen=True)
class Entry:
    kind: str
    config: type
    builder: Callable[..., Any]


_TABLES: dict[str, dict[str, Entry]] = {g: {} for g in GROUPS}


@runtime_checkable
class CrossChecked(Protocol):
    """A component config with rules across the recipe (``where``: its key, e.g. ``tasks.mnist``);
    raises ``mmformer.errors.RecipeError``."""

    def check(self, recipe: Any, where: str) -> None: ...


@runtime_checkable
class TaskParts(Protocol):
    """What a task config uses of ``model``, by the task's own keys: ``tokenizer_refs`` — key → tokenizer
    name (``{"tokenizer": "image", "caption_tokenizer": "text"}``); ``head_refs`` — key → (head name, the
    tokenizer whose tokens reach that head, which fixes the head's input width)."""

    def tokenizer_refs(self) -> dict[str, str]: ...

    def head_refs(self) -> dict[str, tuple[str, str]]: ...


def register(group: str, kind: str, config: type) -> Callable[[Callable], Callable]:
    """Decorator registering ``builder`` as component ``kind`` of ``group``.

    Raises:
        ValueError: unknown group, a ``config`` that is not a dataclass, a task config without
            :class:`TaskParts`, or a kind already taken by another builder.
    """
    if group not in _TABLES:
        raise ValueError(f"unknown registry group {group!r}; choose from {GROUPS}")
    if not is_dataclass(config):
        raise ValueError(f"config for {group} {kind!r} must be a dataclass, got {config!r}")
    if group == "task" and not all(
        callable(getattr(config, m, None)) for m in ("tokenizer_refs", "head_refs")
    ):
        raise ValueError(f"task config {config.__name__} must define tokenizer_refs() and head_refs()")

    def deco(builder: Callable) -> Callable:
        if kind in _TABLES[group] and _TABLES[group][kind].builder is not builder:
            raise ValueError(f"{group} kind {kind!r} is already registered")
        _TABLES[group][kind] = Entry(kind, config, builder)
        return builder

    return deco


def lookup(group: str, kind: str, where: str = "") -> Entry:
    """The entry for ``kind``; ``KeyError`` with a did-you-mean and the known kinds otherwise."""
    table = _TABLES[group]
    if kind not in table:
        close = difflib.get_close_matches(str(kind), table, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        at = f" at '{where}'" if where else ""
        known = ", ".join(sorted(table)) or "none registered (import mmformer.components first)"
        raise KeyError(f"unknown {group} kind {kind!r}{at}.{hint} Known: {known}")
    return table[kind]


def kinds(group: str) -> list[str]:
    return sorted(_TABLES[group])
