"""JSONL manifests: one JSON object per line, blank lines skipped, every error naming ``file:line``."""

from __future__ import annotations

import json
from pathlib import Path

from .roots import DataError


def read_jsonl(path: Path, keys: tuple[str, ...]) -> list[tuple[int, dict]]:
    """``(line number, row)`` for each object of ``path``. Raises ``DataError`` naming ``file:line`` for a
    line that is not UTF-8 or not a JSON object holding every one of ``keys``, and for a file without rows."""
    rows = []
    with open(path, "rb") as f:  # decoded line by line, so an invalid byte is named with its line
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                byte = f"byte 0x{raw[e.start]:02x}: {e.reason}"
                raise DataError(f"{path}:{n}: not UTF-8 text at column {e.start + 1} ({byte})") from None
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


def text_field(path: Path, n: int, row: dict, key: str) -> str:
    """``row[key]``, which must be a string (a null caption would otherwise train on the text "None").
    Raises ``DataError`` naming ``file:line``."""
    value = row[key]
    if not isinstance(value, str):
        raise DataError(f"{path}:{n}: {key!r} must be a string, got {json.dumps(value)[:80]}")
    return value


def label_field(path: Path, n: int, row: dict, key: str) -> str:
    """``row[key]`` as a class name: a string, or a number or boolean (``3`` → ``"3"``); null (which would
    otherwise become a class "None"), a list or an object is refused with ``DataError`` naming
    ``file:line``."""
    value = row[key]
    if value is None or isinstance(value, (list, dict)):
        got = json.dumps(value)[:80]
        raise DataError(f"{path}:{n}: {key!r} must be a class name (a string or a number), got {got}")
    return str(value)
