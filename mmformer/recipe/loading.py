"""Loading a recipe: defaults ← recipe YAML ← ``key=value`` overrides, then every check.

A recipe is YAML read by OmegaConf's own loader (``1e-3`` is a float, ``null`` is None) and merged
into the dataclasses of ``mmformer.recipe.sections``, so unknown keys and wrong types fail with the
full key, a did-you-mean and the expected type. Components (tokenizers, backbone, heads, tasks,
datasets) are picked by ``kind`` from ``mmformer.registry`` (the built-ins register when
``mmformer.components`` is imported, here): OmegaConf cannot switch between dataclass variants on
merge, so ``kind`` is read first and the node is then merged into that kind's dataclass. Every rule
across parts runs here too (``checks.check_recipe``), so ``info``, ``validate``, ``train`` and
``resume`` accept and refuse the same recipes before any data is touched.
"""

from __future__ import annotations

import logging
import re
import typing
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .. import components  # noqa: F401  (registers the built-in kinds the recipe picks from)
from ..errors import RecipeError, did_you_mean
from ..registry import lookup
from .checks import check_recipe, keep_only
from .schema import kind_changes, override_value, unknown_keys, unknown_keys_message
from .sections import RecipeConfig
from .trainer_args import flatten_extra, move_lightning_args, move_override, trainer_keys

log = logging.getLogger("mmformer")


def load_recipe(source: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RecipeConfig:
    """Load a recipe file (``recipe_from_yaml`` loads YAML text, e.g. from a checkpoint).

    Raises:
        RecipeError: unreadable YAML, unknown keys (with a did-you-mean), wrong types, bad values.
        FileNotFoundError: the recipe file does not exist.
    """
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"recipe file not found: {path}")
    try:
        raw = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and friends
        raise RecipeError(f"{path}: not valid YAML: {e}") from e
    return _resolve(raw, overrides, str(path))


def recipe_from_yaml(text: str, overrides: list[str] | tuple[str, ...] = ()) -> RecipeConfig:
    """Load a recipe from YAML text (as stored in checkpoints)."""
    return _resolve(OmegaConf.create(text), overrides, "<yaml>")


def recipe_to_yaml(recipe: RecipeConfig) -> str:
    """The resolved recipe, defaults included, as plain YAML text (reloads to an equal recipe)."""
    return OmegaConf.to_yaml(OmegaConf.create(recipe_to_dict(recipe)))


def recipe_to_dict(recipe: RecipeConfig) -> dict:
    """The resolved recipe as plain dicts / lists / scalars (for loggers and YAML); Lightning arguments
    beyond the typed ones are written under ``trainer``, as a recipe spells them."""
    data = asdict(recipe)
    data["trainer"] = flatten_extra(data["trainer"])
    return data


def header_steps(path: str | Path, source: str) -> list[str]:
    """The ``mmformer …`` commands of a recipe file's header comment up to the first that names
    ``source`` (a fine-tune's ``# Source:`` train and export steps that write the weights it reads); []
    when none names it. The recipe's own launch line is not a step."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#"):
            break  # the header is the leading comment
        m = _COMMAND.search(line)
        if m and Path(path).name not in line:
            steps.append(m.group(0).strip())
            if source in line:
                return steps
    return []


_COMMAND = re.compile(r"\bmmformer (?:train|export|data|validate|generate|sample|info)\b.*")


def _resolve(raw: DictConfig, overrides, origin: str) -> RecipeConfig:
    if not isinstance(raw, DictConfig):
        raise RecipeError(f"{origin}: a recipe must be a mapping of sections, got {type(raw).__name__}")
    cfg = _merged(raw, overrides)
    _guard("", lambda: OmegaConf.resolve(cfg), RecipeConfig)
    for f in fields(RecipeConfig):  # validate section by section, so errors name their section
        if is_dataclass(f.type) or f.name in ("optim", "trainer", "logger", "checkpoint", "multitask"):
            _guard(f.name, lambda n=f.name: OmegaConf.to_object(cfg[n]), RecipeConfig)
    recipe: RecipeConfig = _guard("", lambda: OmegaConf.to_object(cfg), RecipeConfig)

    model = recipe.model
    model.backbone = _component("backbone", model.backbone, "model.backbone", default_kind="transformer")
    model.tokenizers = {
        k: _component("tokenizer", v, f"model.tokenizers.{k}") for k, v in model.tokenizers.items()
    }
    model.towers = {
        k: _component("backbone", v, f"model.towers.{k}", default_kind="transformer")
        for k, v in model.towers.items()
    }
    model.heads = {k: _component("head", v, f"model.heads.{k}") for k, v in model.heads.items()}
    tasks = {}
    for name, node in recipe.tasks.items():
        task = _component("task", node, f"tasks.{name}")
        task.data = _component("dataset", task.data, f"tasks.{name}.data")
        tasks[name] = task
    recipe.tasks = tasks
    recipe.resume = resume_setting(recipe.resume)
    if recipe.multitask.only:
        keep_only(recipe, recipe.multitask.only)
    check_recipe(recipe)
    return recipe


def _merged(raw: DictConfig, overrides) -> DictConfig:
    """Defaults ← ``raw`` ← ``overrides`` as one OmegaConf config (not yet validated section by section).

    Raises:
        RecipeError: every unknown key of the file and of the overrides in one message (a foreign recipe,
            such as timm's ``args.yaml``, has dozens), each with its did-you-mean; else the first value
            OmegaConf refuses.
    """
    raw = _lightning_args_moved(raw)
    unknown = unknown_keys(raw, OmegaConf.to_container(raw))
    known = _without(raw, unknown)
    try:
        cfg = _guard("", lambda: OmegaConf.merge(OmegaConf.structured(RecipeConfig), known), RecipeConfig)
    except RecipeError:
        if not unknown:
            raise
        raise RecipeError(unknown_keys_message(_trainer_options(unknown))) from None
    unknown = _apply_overrides(cfg, overrides, unknown)
    if unknown:
        raise RecipeError(unknown_keys_message(_trainer_options(unknown)))
    return cfg


def _lightning_args_moved(raw: DictConfig) -> DictConfig:
    """``raw`` with the ``lightning.Trainer`` arguments under ``trainer`` that ``TrainerConfig`` does not
    type moved into ``trainer.extra`` (``trainer_args.move_lightning_args``; raises ``RecipeError`` for one
    mmformer sets itself)."""
    if not isinstance(raw.get("trainer"), DictConfig):
        return raw
    data = OmegaConf.to_container(raw)
    data["trainer"] = move_lightning_args(data["trainer"])
    return OmegaConf.create(data)


def _trainer_options(found: list) -> list:
    """Unknown keys with, for those under ``trainer``, every key it takes (Lightning's too) as options."""
    return [(path, trainer_keys() if path[:-1] == ("trainer",) else options) for path, options in found]


def resume_setting(value: str | None) -> str | None:
    """``resume`` as a run reads it: ``"auto"``, a checkpoint path, or None for a new run — also spelled
    ``false``, ``no``, ``off``, ``none``, ``null`` (litgpt's ``resume=false``; YAML's ``resume: no``,
    which a string field holds as ``'False'``)."""
    if value is None or value.strip().lower() in ("", "false", "no", "off", "none", "null", "~"):
        return None
    return value


def _apply_overrides(cfg: DictConfig, overrides, unknown: list) -> list:
    """Apply ``key=value`` overrides in order, each typed by the schema at its key; a mapping is merged
    into the mapping at its key, and where it gives a component another ``kind`` (at any depth) the
    component's options that the new kind lacks are dropped first, with a warning naming them
    (``model.heads.x={kind: classifier, num_classes: 2}`` over a ``pair_classifier`` drops its
    ``interaction`` and ``mlp_dim``, keeps ``pool``). Returns ``unknown``
    with every unknown key the overrides name added (those overrides are not applied); after the first
    unknown key, an override that fails otherwise stops the loop instead of raising.

    Raises:
        RecipeError: a malformed override, or one OmegaConf refuses (wrong type) while none is unknown.
    """
    unknown = list(unknown)
    for item in overrides:
        key, value = _parse_override(item, cfg)
        path = _key_path(key)
        moved, value = move_override(path, value)  # trainer.fast_dev_run → trainer.extra.fast_dev_run
        if moved != path:
            key, path = ".".join(moved), moved
        found = unknown_keys(cfg, _nested(path, value))
        if found:
            unknown += found
            continue
        for where, old, new, dropped in kind_changes(cfg, _nested(path, value)):
            # another kind: the old component's options that the new kind lacks are dropped, not merged
            component = OmegaConf.select(cfg, ".".join(where))
            for k in dropped:
                del component[k]
            if dropped:
                log.warning(
                    f"override {item!r}: '{'.'.join(where)}' changes kind {old} → {new}; dropped the {old} "
                    f"options {', '.join(dropped)} (the others are kept)"
                )
        for where, old, new, dropped in kernel_changes(cfg, _nested(path, value)):
            options = OmegaConf.select(cfg, ".".join((*where, "kernel_options")))
            for k in dropped:
                del options[k]
            log.warning(
                f"override {item!r}: '{'.'.join(where)}.attn_kernel' changes {old} → {new}; dropped the "
                f"kernel_options {', '.join(dropped)}, which {new} does not take"
            )
        try:
            _guard("", lambda k=key, v=value: OmegaConf.update(cfg, k, v, merge=True), RecipeConfig, key)
        except RecipeError:
            if unknown:
                break
            raise
    return unknown


def kernel_changes(cfg: DictConfig, override: dict, where: tuple[str, ...] = ()):
    """``(where, old, new, dropped)`` for each backbone that ``override`` (a nested mapping) gives
    another ``attn_kernel``: ``dropped`` are its ``kernel_options`` that the new kernel does not take
    (``nn.kernels.option_names``; none are yielded when nothing is dropped)."""
    from ..nn.kernels import option_names

    if not isinstance(override, dict):
        return
    node = OmegaConf.select(cfg, ".".join(where)) if where else cfg
    new = override.get("attn_kernel")
    if (
        isinstance(new, str)
        and isinstance(node, DictConfig)
        and isinstance(node.get("kernel_options"), DictConfig)
    ):
        old = node.get("attn_kernel")
        dropped = [k for k in node.kernel_options if k not in option_names(new)]
        if old != new and dropped:
            yield where, old, new, dropped
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(node, DictConfig) and key in node:
            yield from kernel_changes(cfg, value, (*where, str(key)))


def _parse_override(item: str, cfg: DictConfig) -> tuple[str, Any]:
    """``(key, value)`` of ``key=value``, the value typed by the schema at ``key``
    (``mmformer.recipe.schema.override_value``). Raises ``RecipeError`` for a malformed override."""
    if "=" not in item:
        raise RecipeError(f"override {item!r} is not of the form key=value (e.g. optim.lr=3e-4)")
    key, _, text = item.partition("=")
    key = key.strip()
    try:
        return key, override_value(text, cfg, _key_path(key))
    except yaml.YAMLError as e:
        split = text.count("{") > text.count("}") or text.count("[") > text.count("]")
        hint = f"; the shell split it at a space: quote the whole override, '{key}={text} …'" if split else ""
        raise RecipeError(
            f"override {item!r}: the value is not valid YAML ({str(e).splitlines()[0]}){hint}"
        ) from None


def _key_path(key: str) -> tuple[str, ...]:
    """``optim.betas[1]`` → ``('optim', 'betas', '1')``."""
    return tuple(re.sub(r"\[([^\]]*)\]", r".\1", key).split("."))


def _nested(path: tuple[str, ...], value: Any) -> dict:
    """``{'optim': {'lr': value}}`` for ``('optim', 'lr')``."""
    for part in reversed(path):
        value = {part: value}
    return value


def _without(raw: DictConfig, unknown: list) -> DictConfig:
    """``raw`` less the keys at the paths in ``unknown`` (the rest is still checked)."""
    if not unknown:
        return raw
    data = OmegaConf.to_container(raw)
    for path, _ in unknown:
        node = data
        for part in path:  # the paths name keys as text: a YAML key may be a number
            parent, node = node, next((v for k, v in node.items() if str(k) == part), None)
        parent.pop(next(k for k in parent if str(k) == path[-1]))
    return OmegaConf.create(data)


def _component(group: str, node: Any, where: str, default_kind: str | None = None):
    """Validate one component node against the dataclass registered for its ``kind``."""
    if not isinstance(node, dict):
        raise RecipeError(f"'{where}' must be a mapping with a 'kind', got {node!r}")
    kind = node.get("kind", default_kind)
    if kind is None:
        raise RecipeError(f"'{where}' needs a 'kind' (the {group} to build)")
    try:
        entry = lookup(group, kind, where + ".kind")
    except KeyError as e:
        raise RecipeError(e.args[0]) from None
    node = dict(node, kind=kind)
    merged = _guard(where, lambda: OmegaConf.merge(OmegaConf.structured(entry.config), node), entry.config)
    return _guard(where, lambda: OmegaConf.to_object(merged), entry.config)


def _guard(prefix: str, fn, schema: type, key_hint: str | None = None):
    """Run an OmegaConf operation, turning its errors into a RecipeError naming the full key."""
    try:
        return fn()
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or key_hint or ""
        full = f"{prefix}.{key}" if prefix and key else (prefix or key)
        first = str(e).split("\n")[0]
        if "not in" in first or "Key '" in first and "not" in first:
            raise RecipeError(_unknown_key_message(full, schema, key)) from None
        if "Missing mandatory value" in first:
            raise RecipeError(f"'{full}' is required but not set") from None
        m = re.match(r"Value '(.*)' of type '(.*)' could not be converted to (\w+)", first)
        if m:
            expected = {"Integer": "int", "Float": "float", "Boolean": "bool", "String": "str"}.get(
                m.group(3), m.group(3)
            )
            raise RecipeError(f"'{full}' expects {expected}, got {m.group(1)!r} ({m.group(2)})") from None
        raise RecipeError(f"'{full}': {first}") from None
    except (ValueError, TypeError, KeyError) as e:
        if isinstance(e, RecipeError):
            raise
        raise RecipeError(f"'{prefix or schema.__name__}': {e.args[0] if e.args else e}") from None


def _unknown_key_message(full: str, schema: type, key: str) -> str:
    parent = _schema_at(schema, key.split(".")[:-1]) if key else None
    last = full.split(".")[-1]
    options = [f.name for f in fields(parent)] if parent else []
    base = full.rsplit(".", 1)[0] + "." if "." in full else ""
    hint = did_you_mean(last, options, cutoff=0.5).replace(" Did you mean '", f" Did you mean '{base}")
    valid = f" Valid keys here: {', '.join(options)}." if options else ""
    return f"unknown recipe key '{full}'.{hint}{valid}"


def _schema_at(schema: type, path: list[str]) -> type | None:
    """The dataclass that describes the node at ``path`` inside ``schema`` (None when free-form)."""
    cls = schema
    for part in path:
        if not is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        cls = hints[part]
        if typing.get_origin(cls) is not None:  # dict / list / Optional: free-form below here
            return None
    return cls if is_dataclass(cls) else None
