"""Where data lives: the data root (``$MMFORMER_DATA``, default ``./data``) and how a recipe's
``data.root`` resolves — a path, or the name of a bundled dataset under the data root."""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path

log = logging.getLogger("mmformer.data")


class DataNotFoundError(FileNotFoundError):
    """A dataset path that does not exist; the message says how to make it."""


class DataError(ValueError):
    """Data that does not fit the recipe (class folders vs ``num_classes``, too few samples)."""


def data_root() -> Path:
    return Path(os.environ.get("MMFORMER_DATA", "data"))


def resolve_root(root: str, prepare_missing: bool = True) -> Path:
    """Resolve ``root``: a bundled name (``mnist5k``) → ``<data root>/mnist5k``, prepared first if it
    is missing and ``prepare_missing``; anything else is a filesystem path that must exist.

    Raises:
        DataNotFoundError: the path does not exist (naming it, and the ``mmformer data prepare``
            command when it looks like a bundled dataset).
    """
    # Imported here, not at the top: preparing a bundled dataset needs ``data_root`` from this module, and
    # every data module resolves its root through this one (the one lazy import between mmformer modules).
    from .prepare import BUNDLED, prepare

    if root in BUNDLED:
        path = data_root() / root
        if not BUNDLED[root].is_prepared(path):
            if not prepare_missing:
                raise DataNotFoundError(
                    f"bundled dataset {root!r} is not prepared at {path}; run: mmformer data prepare {root}"
                )
            log.warning("bundled dataset %r is missing at %s: preparing it now", root, path)
            prepare(root)
        return path
    path = Path(root).expanduser()
    if path.exists():
        return path
    where = "" if path.is_absolute() else f" (relative to the current directory {Path.cwd()})"
    msg = f"data root {str(path)!r} does not exist{where}"
    under = data_root() / path
    if not path.is_absolute() and under.exists():  # a folder beside the bundled sets, named relatively
        msg += f". {str(under)!r} exists: only bundled names resolve under the data root; give that path"
    close = difflib.get_close_matches(path.name, BUNDLED, n=1, cutoff=0.6)
    if close:
        msg += (
            f". Did you mean the bundled dataset {close[0]!r}? Set the root to {close[0]!r}: it is "
            f"prepared automatically (or run: mmformer data prepare {close[0]})"
        )
    raise DataNotFoundError(msg)
