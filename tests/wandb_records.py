"""Read a W&B offline ``run-*.wandb`` file back (LevelDB-style log of ``Record`` protobufs):
a 7-byte file header, then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length,
type: 1 full, 2 first, 3 middle, 4 last)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from mmformer.training.history import wandb_records


def read_records(path: Path, settle: float = 30.0) -> list:
    """Every record of the file, once it is whole: W&B's writer process may still be appending after
    ``finish()`` returns, so the file is read again until it parses and ends with the run's ``exit``
    record, or (a killed run has none) parses and stays unchanged for 2 s; ``settle``: the longest wait
    in seconds."""
    deadline, data, since = time.monotonic() + settle, None, time.monotonic()
    while True:
        now, new = time.monotonic(), Path(path).read_bytes()
        if new != data:
            data, since = new, now
        records = _parse(data)  # whole records only: one cut off mid-write is left for the next read
        ended = bool(records) and records[-1].WhichOneof("record_type") == "exit"
        if ended or now - since >= 2.0 or now > deadline:
            return records
        time.sleep(0.2)


def _parse(data: bytes) -> list:
    return [record for _, record in wandb_records(data)]  # the reader mmformer cuts resumed segments with


def history_and_config(path: Path) -> tuple[list[dict], dict]:
    """``(history rows {key: value}, config {key: value})`` from an offline run file."""
    rows, config = [], {}
    for r in read_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in r.history.item
                }
            )
        elif kind == "config":
            for item in r.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return rows, config
