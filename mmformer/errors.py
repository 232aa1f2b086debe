"""``RecipeError`` and the few helpers every recipe section and component config phrases its errors
with: one did-you-mean, and the positive / probability checks of ``__post_init__``."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the key and what was expected."""


def did_you_mean(word: object, options: Iterable[str], cutoff: float = 0.6, quote: str = "'") -> str:
    """`` Did you mean 'x'?`` for the option closest to ``word`` (one that differs in case only first),
    or ``""`` when none is close."""
    options = list(options)
    same = [o for o in options if o.lower() == str(word).lower()]
    close = same or difflib.get_close_matches(str(word), options, n=1, cutoff=cutoff)
    return f" Did you mean {quote}{close[0]}{quote}?" if close else ""


def positive(cfg, *names: str) -> None:
    """Raises ``ValueError`` naming the first of ``names`` that is set and not > 0."""
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def probability(cfg, *names: str) -> None:
    """Raises ``ValueError`` naming the first of ``names`` outside [0, 1)."""
    for name in names:
        value = getattr(cfg, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")


def non_negative_weight(cfg) -> None:
    if cfg.weight < 0:
        raise ValueError(f"weight must be >= 0, got {cfg.weight}")


class SourceNotFoundError(RecipeError):
    """A pretrained ``source`` the recipe names that is neither a path here nor a known name; ``source``
    is the recipe's text (the CLI adds the recipe header's steps that create it)."""

    def __init__(self, message: str, source: str):
        super().__init__(message)
        self.source = source


class UsageError(Exception):
    """Bad command-line input; the CLI prints it as one ``mmformer: error:`` line (exit status 2)."""
