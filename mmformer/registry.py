"""Name → (config dataclass, builder) tables. Users add their own components with ``register``::

    from mmformer.registry import register

    @dataclass
    class MyHeadConfig:
        kind: str = "my_head"
        num_classes: int = 10

    @register("head", "my_head", MyHeadConfig)
    def build_my_head(cfg: MyHeadConfig, d_model: int, tokenizer) -> nn.Module: ...

A recipe then selects it with ``kind: my_head`` and its keys are validated against ``MyHeadConfig``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, is_dataclass
from typing import Any

GROUPS = ("tokenizer", "backbone", "head", "task", "dataset")


@dataclass(frozen=True)
class Entry:
    kind: str
    config: type
    builder: Callable[..., Any]


_TABLES: dict[str, dict[str, Entry]] = {g: {} for g in GROUPS}


def register(group: str, kind: str, config: type) -> Callable[[Callable], Callable]:
    """Decorator registering ``builder`` as component ``kind`` of ``group``.

    Raises:
        ValueError: unknown group, a ``config`` that is not a dataclass, or a kind already taken.
    """
    if group not in _TABLES:
        raise ValueError(f"unknown registry group {group!r}; choose from {GROUPS}")
    if not is_dataclass(config):
        raise ValueError(f"config for {group} {kind!r} must be a dataclass, got {config!r}")

    def deco(builder: Callable) -> Callable:
        if kind in _TABLES[group] and _TABLES[group][kind].builder is not builder:
            raise ValueError(f"{group} kind {kind!r} is already registered")
        _TABLES[group][kind] = Entry(kind, config, builder)
        return builder

    return deco


def lookup(group: str, kind: str, where: str = "") -> Entry:
    """The entry for ``kind``; ``KeyError`` with a did-you-mean and the known kinds otherwise."""
    _ensure_builtins()
    table = _TABLES[group]
    if kind not in table:
        close = difflib.get_close_matches(str(kind), table, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        at = f" at '{where}'" if where else ""
        raise KeyError(f"unknown {group} kind {kind!r}{at}.{hint} Known: {', '.join(sorted(table))}")
    return table[kind]


def kinds(group: str) -> list[str]:
    _ensure_builtins()
    return sorted(_TABLES[group])


def _ensure_builtins() -> None:
    # The built-in components are registered by the composition root when it is imported.
    from . import build  # noqa: F401
