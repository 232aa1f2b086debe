"""Read a W&B offline ``run-*.wandb`` file back (LevelDB-style log of ``Record`` protobufs):
a 7-byte file header, then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length,
type: 1 full, 2 first, 3 middle, 4 last)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK, HEADER = 32 * 1024, 7


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
        try:
            records = _parse(data)
        except Exception:  # a record cut off mid-write
            records = None
        ended = bool(records) and records[-1].WhichOneof("record_type") == "exit"
        if ended or (records is not None and now - since >= 2.0) or now > deadline:
            return records if records is not None else _parse(data)
        time.sleep(0.2)


def _parse(data: bytes) -> list:
    from wandb.proto import wandb_internal_pb2

    pos, pending, records = HEADER, b"", []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


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
