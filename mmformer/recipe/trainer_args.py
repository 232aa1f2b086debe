"""Lightning's ``Trainer``, not a hand-kept subset: the recipe's ``trainer`` section takes every argument
of ``lightning.Trainer.__init__`` of the installed Lightning.

``TrainerConfig`` types mmformer's own keys (``validate_first``, ``compile``, ``activation_checkpointing``,
``onednn_linears``, ``threads``) and the Lightning arguments recipes set most; any other one
(``fast_dev_run``, ``profiler``, ``overfit_batches``, ``detect_anomaly``, ``benchmark``, ``min_epochs`` …)
is written under ``trainer`` as well. The loader moves it into ``trainer.extra``
(:func:`move_lightning_args`), where it is checked against ``inspect.signature(lightning.Trainer.__init__)``
and its annotation (:func:`check_extra`); ``build_trainer`` passes it through, and the resolved recipe
writes it back under ``trainer`` (:func:`flatten_extra`). The arguments mmformer sets itself are
refused, each with its reason (``SET_BY_MMFORMER``); an unknown key gets a did-you-mean over all of them
(:func:`trainer_keys`).
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from dataclasses import fields
from typing import Any, Literal, Union

from ..errors import RecipeError, did_you_mean

EXTRA = "extra"

# Trainer arguments mmformer sets itself, and why a recipe does not.
SET_BY_MMFORMER = {
    "logger": "mmformer builds the loggers from the recipe's 'logger' section (CSV always, then "
    "logger.kinds: wandb, tensorboard, mlflow)",
    "callbacks": "mmformer adds its own callbacks (checkpoints, throughput, media, EMA); from Python, pass "
    "extra_callbacks to mmformer.commands.train.train",
    "plugins": "mmformer sets its checkpoint IO (atomic writes) itself",
    "default_root_dir": "the run folder is <runs root>/<recipe name>/<run id> (MMFORMER_RUNS moves the runs root)",
    "use_distributed_sampler": "the datamodule shards the data itself (evaluation without padded samples)",
    "enable_checkpointing": "checkpoints are the 'checkpoint' section's (save_top_k, save_last)",
    "inference_mode": "validation runs under no_grad so metric states stay usable (trainer.validate_first)",
    "barebones": "it turns off the loggers, checkpoints and callbacks every mmformer run relies on; for a "
    "quick check use trainer.fast_dev_run=true",
}

# the profilers Lightning's ``Trainer(profiler=<name>)`` builds (``trainer/setup.py``, ``_init_profiler``)
PROFILER_NAMES = ("simple", "advanced", "pytorch", "xla")


@functools.cache
def lightning_arguments() -> dict[str, Any]:
    """``{name: annotation}`` of ``lightning.Trainer.__init__``'s arguments (``Any`` where a hint does not
    resolve), in signature order."""
    import lightning

    init = lightning.Trainer.__init__
    try:
        hints = typing.get_type_hints(init)
    except Exception:  # an annotation this Python cannot evaluate: names only, Lightning checks values
        hints = {}
    params = inspect.signature(init).parameters
    return {name: hints.get(name, Any) for name in params if name != "self"}


def typed_keys() -> list[str]:
    """The ``trainer`` keys ``TrainerConfig`` types (its fields, less ``extra``)."""
    from .sections import TrainerConfig

    return [f.name for f in fields(TrainerConfig) if f.name != EXTRA]


def trainer_keys() -> list[str]:
    """Every key the ``trainer`` section takes: the typed ones, then Lightning's other arguments."""
    typed = typed_keys()
    return typed + [k for k in lightning_arguments() if k not in typed and k not in SET_BY_MMFORMER]


def move_lightning_args(node: Any) -> Any:
    """The ``trainer`` section ``node`` (a plain dict) with every key that is a ``lightning.Trainer``
    argument but no ``TrainerConfig`` field moved into ``extra`` (which the ``extra`` the node already
    has overrides); other values are returned unchanged. Keys that are neither stay for the unknown-key
    check.

    Raises:
        RecipeError: a key is an argument mmformer sets itself (the message gives the reason).
    """
    if not isinstance(node, dict):
        return node
    typed, lightning = set(typed_keys()), lightning_arguments()
    kept, moved = {}, {}
    for key, value in node.items():
        name = str(key)
        if name in SET_BY_MMFORMER:
            raise RecipeError(refused_message(name))
        if name not in typed and name != EXTRA and name in lightning:
            moved[name] = value
        else:
            kept[key] = value
    if moved:
        given = kept.get(EXTRA)
        kept[EXTRA] = {**moved, **given} if isinstance(given, dict) else moved
    return kept


def move_override(path: tuple[str, ...], value: Any) -> tuple[tuple[str, ...], Any]:
    """An override's ``(key path, value)`` with a Lightning argument under ``trainer`` moved into
    ``trainer.extra`` (``trainer.fast_dev_run`` → ``trainer.extra.fast_dev_run``; a whole ``trainer={…}``
    through :func:`move_lightning_args`).

    Raises:
        RecipeError: the override sets an argument mmformer sets itself.
    """
    if not path or path[0] != "trainer":
        return path, value
    if len(path) == 1:
        return path, move_lightning_args(value)
    name = path[1]
    if name in SET_BY_MMFORMER:
        raise RecipeError(refused_message(name))
    if name not in typed_keys() and name != EXTRA and name in lightning_arguments():
        return ("trainer", EXTRA, *path[1:]), value
    return path, value


def refused_message(name: str) -> str:
    return f"'trainer.{name}' cannot be set in a recipe: {SET_BY_MMFORMER[name]}"


def check_extra(extra: dict) -> None:
    """Raises ``ValueError`` for an ``extra`` key that is no ``lightning.Trainer`` argument (with a
    did-you-mean over every ``trainer`` key), one mmformer sets itself, a typed ``TrainerConfig`` field, or
    a value that does not fit Lightning's annotation (``fast_dev_run: int | bool`` …)."""
    if not extra:
        return
    typed, lightning = typed_keys(), lightning_arguments()
    for key, value in extra.items():
        if key in SET_BY_MMFORMER:
            raise ValueError(f"{key} cannot be set in a recipe: {SET_BY_MMFORMER[key]}")
        if key in typed:
            raise ValueError(f"{key} is a typed trainer key: set trainer.{key}, not trainer.extra.{key}")
        if key not in lightning:
            hint = did_you_mean(key, trainer_keys(), cutoff=0.5)
            raise ValueError(f"{key} is not an argument of lightning.Trainer.{hint}")
        tp = lightning[key]
        if not fits(value, tp):
            raise ValueError(f"{key} expects {describe(tp)}, got {value!r} ({type(value).__name__})")
        if key == "profiler" and isinstance(value, str) and value.lower() not in PROFILER_NAMES:
            hint = did_you_mean(value.lower(), PROFILER_NAMES)
            raise ValueError(f"profiler={value!r}; choose {' | '.join(PROFILER_NAMES)}.{hint}".rstrip("."))


def flatten_extra(trainer: dict) -> dict:
    """A plain ``trainer`` section (``asdict`` of ``TrainerConfig``) with ``extra``'s keys written beside
    the typed ones, as a recipe spells them (reloading moves them back)."""
    out = {k: v for k, v in trainer.items() if k != EXTRA}
    out.update(trainer.get(EXTRA) or {})
    return out


def fits(value: Any, tp: Any) -> bool:
    """Whether a YAML value (None, bool, int, float, str, list, dict) fits annotation ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is not None:
        tp = origin
    return isinstance(tp, type) and isinstance(value, tp)


def describe(tp: Any) -> str:
    """``int | bool`` for ``Union[int, bool]``; Literal values shown as written."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(describe(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))
