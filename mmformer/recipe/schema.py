"""What the recipe's dataclasses say about a key path: the type a ``key=value`` override is read as, and
every key a recipe or its overrides name that no dataclass has.

A path is walked from ``RecipeConfig`` through its sections' fields, the values of ``dict[str, X]`` and
the items of ``list[X]``; a component node (``model.backbone``, ``model.tokenizers.<n>``, ``tasks.<n>``,
``tasks.<n>.data`` …) is read with the dataclass registered for its ``kind`` (``mmformer.registry``).
Where nothing is known (``Any`` fields, an unknown kind) the answer is ``Any``: YAML typing, as before.

Overrides are typed by that schema, not by YAML 1.1 alone: a ``str`` field keeps the text as typed
(``name=no`` is ``'no'``, ``data.root=0123`` is ``'0123'``, ``logger.tags=[1e5]`` is ``['1e5']``), an
``int`` / ``float`` field reads the text as a decimal number (``0123`` is 123, not octal 83), a ``bool``
field takes YAML's spellings (true, no, on …), and ``null`` / ``~`` give None where the field is
Optional.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Union

import yaml
from omegaconf import OmegaConf

from ..errors import did_you_mean
from ..registry import lookup
from .sections import RecipeConfig

# component nodes: their keys are those of the config registered for their kind (group, default kind)
_SLOTS = {
    ("model", "backbone"): ("backbone", "transformer"),
    ("model", "towers", "*"): ("backbone", "transformer"),
    ("model", "tokenizers", "*"): ("tokenizer", None),
    ("model", "heads", "*"): ("head", None),
    ("tasks", "*"): ("task", None),
    ("tasks", "*", "data"): ("dataset", None),
}
_NULLS = ("null", "Null", "NULL", "~")


def type_at(cfg, path: tuple[str, ...], kinds: dict | None = None) -> Any:
    """The type the schema gives the node at ``path`` (``Any`` where free-form or unknown). ``kinds``:
    component kinds by path, read before ``cfg``'s (an override that sets a whole component)."""
    tp: Any = RecipeConfig
    for i, part in enumerate(path):
        tp = _child(tp, part)
        slot = _SLOTS.get(_pattern(path[: i + 1]))
        if slot is not None:
            tp = _kind_config(cfg, path[: i + 1], slot, kinds or {})
        if tp is Any:
            return Any
    return tp


def field_names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def unknown_keys(cfg, node: Any, path: tuple[str, ...] = (), kinds: dict | None = None) -> list:
    """``(path of the key, the keys valid there)`` for every key of ``node`` (plain dicts, the recipe's value
    at ``path``) that the schema does not know; ``cfg`` supplies the kinds ``node`` does not set."""
    if not isinstance(node, dict):
        return []
    kinds = dict(kinds or {})
    if isinstance(node.get("kind"), str) and _pattern(path) in _SLOTS:
        kinds[path] = node["kind"]
    tp = _strip_optional(type_at(cfg, path, kinds))
    names = field_names(tp) if is_dataclass(tp) else None
    found = []
    for key, value in node.items():
        here = (*path, str(key))
        if names is not None and str(key) not in names:
            found.append((here, names))
        else:
            found += unknown_keys(cfg, value, here, kinds)
    return found


def kind_changes(
    cfg, node: Any, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], str, str, list[str]]]:
    """``(path, old kind, new kind, keys of the old component the new kind does not have)`` for every
    component that ``node`` (an override's value at ``path``, nested mappings included) gives another
    ``kind`` than ``cfg`` has there (the slot's default kind where ``cfg`` names none). Unknown kinds,
    unreadable ones (an unresolvable interpolation, ``???``) and components reached through an
    interpolation (an alias of another component, which the override replaces whole) are left out."""
    if not isinstance(node, dict):
        return []
    found = []
    slot = _SLOTS.get(_pattern(path))
    new = node.get("kind")
    old_node = _plain_node(cfg, path) if slot is not None and isinstance(new, str) else None
    if old_node is not None:
        here = ".".join(path)
        old = OmegaConf.select(cfg, here + ".kind", default=None, throw_on_resolution_failure=False)
        if "kind" not in old_node.keys():  # the file names no kind: the slot's default (a ??? value counts)
            old = slot[1]
        if isinstance(old, str):  # else unreadable (an unresolvable interpolation, ???): left to the checks
            try:
                keep = field_names(lookup(slot[0], new).config)
            except KeyError:
                keep = None
            if old != new and keep is not None:
                dropped = [str(k) for k in old_node.keys() if str(k) not in keep]
                found.append((path, old, new, dropped))
    for key, value in node.items():
        found += kind_changes(cfg, value, (*path, str(key)))
    return found


def _plain_node(cfg, path: tuple[str, ...]):
    """The mapping at ``path`` when neither it nor any parent is an interpolation, else None."""
    node = cfg
    for key in path:
        if not OmegaConf.is_dict(node) or key not in node or OmegaConf.is_interpolation(node, key):
            return None
        node = node[key]
    return node if OmegaConf.is_dict(node) else None


def unknown_keys_message(found: list) -> str:
    """One line naming every unknown key, each with its did-you-mean (the valid keys for a lone one)."""
    found = [(".".join(path), options) for path, options in found]
    if len(found) == 1:
        ((full, options),) = found
        return f"unknown recipe key '{full}'.{_hint(full, options)} Valid keys here: {', '.join(options)}."
    named = []
    for full, options in found:
        hint = _hint(full, options).replace(" Did you mean", " (did you mean", 1)
        named.append(f"'{full}'" + (hint + ")" if hint else ""))
    return f"{len(found)} unknown recipe keys: {', '.join(named)}"


def _hint(full: str, options: list[str]) -> str:
    """`` Did you mean 'optim.lr'?`` (the whole key) for ``optim.lrr``, or ``""``."""
    base = full.rsplit(".", 1)[0] + "." if "." in full else ""
    hint = did_you_mean(full.split(".")[-1], options, cutoff=0.5)
    return hint.replace(" Did you mean '", f" Did you mean '{base}")


def override_value(text: str, cfg, path: tuple[str, ...]) -> Any:
    """The value of ``key=text`` as the schema types the key (see the module docstring); ``Any`` keys
    get YAML's typing. Raises ``yaml.YAMLError`` for text YAML cannot read where YAML is needed."""
    tp = type_at(cfg, path)
    optional, bare = _is_optional(tp), _strip_optional(tp)
    if bare is str:
        return _text(text, optional)
    typed = _yaml(text)
    if bare is Any:
        return typed
    return _retyped(yaml.compose(text, Loader=yaml.SafeLoader), typed, cfg, path, {})


def _yaml(text: str) -> Any:
    """``text`` as OmegaConf's own YAML reads it (``1e-3`` a float), as plain values."""
    value = OmegaConf.from_dotlist([f"v={text}"]).v
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _text(text: str, optional: bool) -> str | None:
    """A string field's value: the text as typed, unquoted when wholly quoted; None for YAML's null
    spellings (and nothing at all) where the field is Optional."""
    bare = text.strip()
    if optional and bare in ("", *_NULLS):
        return None
    if len(bare) >= 2 and bare[0] == bare[-1] and bare[0] in "'\"":
        try:
            return str(yaml.safe_load(bare))
        except yaml.YAMLError:
            return text
    return text


def _retyped(node, typed: Any, cfg, path: tuple[str, ...], kinds: dict) -> Any:
    """``typed`` (YAML's reading) with every scalar the schema types redone from its text in ``node``."""
    if isinstance(typed, dict) and isinstance(typed.get("kind"), str) and _pattern(path) in _SLOTS:
        kinds = {**kinds, path: typed["kind"]}
    tp = type_at(cfg, path, kinds)
    optional, tp = _is_optional(tp), _strip_optional(tp)
    if isinstance(node, yaml.ScalarNode):
        return _scalar(node, typed, tp, optional)
    if isinstance(node, yaml.SequenceNode) and isinstance(typed, list) and len(typed) == len(node.value):
        return [
            _retyped(n, t, cfg, (*path, str(i)), kinds) for i, (n, t) in enumerate(zip(node.value, typed))
        ]
    if isinstance(node, yaml.MappingNode) and isinstance(typed, dict) and len(typed) == len(node.value):
        pairs = zip(node.value, typed.items())
        return {
            k: _retyped(vn, v, cfg, (*path, str(k)), kinds) if kn.value == str(k) else v
            for (kn, vn), (k, v) in pairs
        }
    return typed


def _scalar(node: yaml.ScalarNode, typed: Any, tp: Any, optional: bool) -> Any:
    if optional and node.tag == "tag:yaml.org,2002:null":
        return None
    if tp is str:
        return node.value
    if tp in (int, float) and node.tag != "tag:yaml.org,2002:bool":
        try:
            return tp(node.value.replace("_", ""))  # decimal, as written (YAML 1.1 reads 0123 as octal)
        except ValueError:
            return typed  # OmegaConf names the key and the expected type
    return typed


def _pattern(path: tuple[str, ...]) -> tuple[str, ...]:
    """``path`` with its free names starred as ``_SLOTS`` spells them (``tasks.mnist`` → ``tasks.*``)."""
    if len(path) >= 2 and path[0] == "tasks":
        return ("tasks", "*", *path[2:])
    if len(path) == 3 and path[0] == "model" and path[1] in ("towers", "tokenizers", "heads"):
        return (*path[:2], "*")
    return path


def _kind_config(cfg, path: tuple[str, ...], slot: tuple, kinds: dict) -> Any:
    group, default = slot
    kind = kinds.get(path) or OmegaConf.select(
        cfg, ".".join(path) + ".kind", default=None, throw_on_resolution_failure=False
    )
    try:
        return lookup(group, kind or default).config
    except (KeyError, TypeError):  # no kind yet, or one the loader reports itself
        return Any


def _child(tp: Any, part: str) -> Any:
    tp = _strip_optional(tp)
    if is_dataclass(tp):
        try:
            return typing.get_type_hints(tp).get(part, Any)
        except Exception:  # a user's config whose annotations do not resolve: free-form
            return Any
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is dict and len(args) == 2:
        return args[1]
    if origin is list and args and part.isdigit():
        return args[0]
    return Any


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def _strip_optional(tp: Any) -> Any:
    """``X`` of ``Optional[X]``; ``Any`` for other unions (YAML decides)."""
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return tp
    rest = [a for a in typing.get_args(tp) if a is not type(None)]
    return rest[0] if len(rest) == 1 else Any
