"""A resolved recipe as its difference from the defaults: what ``mmformer train`` prints at start (the
whole recipe goes to the run folder's ``recipe.yaml``).

Every section and component is a dataclass, so "the default" of a value is its field's default in the
dataclass that holds it. Kept: fields with no default (a component's required sizes), values that
differ from their default (what the recipe file and the overrides set, and what a preset or a check
derived from them), and every component's ``kind`` (what was built). Model parts and tasks (the
entries of ``model.tokenizers``, ``tasks``, …) have no default, so each is shown, less its defaults.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, asdict, fields, is_dataclass
from typing import Any

import yaml

from .sections import RecipeConfig
from .trainer_args import flatten_extra


def non_defaults(recipe: RecipeConfig) -> dict:
    """The recipe's values that differ from the defaults, as nested plain dicts in schema order (the
    Lightning arguments of ``trainer.extra`` beside the typed ones, as a recipe spells them)."""
    out = _diff(recipe)
    if "trainer" in out:
        out["trainer"] = flatten_extra(out["trainer"])
    return out


def non_defaults_yaml(recipe: RecipeConfig) -> str:
    """:func:`non_defaults` as YAML: block mappings, lists of scalars on one line (``betas: [0.9, 0.98]``)."""
    return yaml.dump(non_defaults(recipe), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=110)


def _default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _diff(node: Any) -> dict:
    out = {}
    for f in fields(node):
        value, default = getattr(node, f.name), _default(f)
        if f.name == "kind" or default is MISSING:
            out[f.name] = _plain(value)
        elif is_dataclass(value):  # a section, or an optional part such as model.lora (default None)
            if value != default:
                out[f.name] = _diff(value)
        elif isinstance(value, dict) and any(is_dataclass(v) for v in value.values()):  # named parts
            if value != default:
                out[f.name] = {k: _diff(v) if is_dataclass(v) else _plain(v) for k, v in value.items()}
        elif value != default:
            out[f.name] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    return asdict(value) if is_dataclass(value) else value


class _Dumper(yaml.SafeDumper):
    pass


def _list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(x, (dict, list)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _list)
