"""JSONL manifests: one JSON object per line, blank lines skipped, every error naming ``file:line``."""

from __future__ import annotations

import json
from pathlib import Path

from .roots import DataError


def read_jsonl(path: Path, keys: tuple[str, ...]) -> list[tuple[int, dict]]:
    """``(line number, row)`` for each object of ``path``. Raises ``DataError`` for a line that is not a
    JSON object holding every one of ``keys``, and for a file without rows."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                missing = [k for k in keys if k not in row]
            except (json.JSONDecodeError, TypeError) as e:
                raise DataError(
                    f"{path}:{n}: expected a JSON object with {list(keys)}, got {line[:80]!r} ({e})"
                ) from None
            if not isinstance(row, dict) or missing:
                raise DataError(f"{path}:{n}: expected a JSON object with {list(keys)}, got {line[:80]!r}")
            rows.append((n, row))
    if not rows:
        raise DataError(f"{path} has no rows")
    return rows
