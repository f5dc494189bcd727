"""Read an offline W&B run's ``.wandb`` file back: the records wandb wrote, as protobuf messages.

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version), then 32 KiB
blocks of chunks, each with a 7-byte header (checksum, length, type: 1 full, 2 first, 3 middle,
4 last); a block's tail shorter than a chunk header is padding.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    ident, magic, _ = HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"not a .wandb file: header {ident!r} {magic:#x}")
    pos, parts = HEADER.size, []
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:
            pos += left
            continue
        _, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0:  # zero padding up to the end of the block
            pos += left
            continue
        if pos + CHUNK.size + length > len(data):
            return  # a chunk still being written
        parts.append(data[pos + CHUNK.size : pos + CHUNK.size + length])
        pos += CHUNK.size + length
        if kind in (FULL, LAST):
            yield b"".join(parts)
            parts = []


def records(run_dir: Path, timeout: float = 30.0) -> list[Any]:
    """Every record of the run in ``run_dir`` (an ``offline-run-*`` folder). ``finish()`` may return
    while wandb's service process is still writing the file: wait (up to ``timeout`` seconds) until
    its last record, ``exit``, is there."""
    deadline = time.monotonic() + timeout
    while True:
        found = _read_records(run_dir)
        if (found and found[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _read_records(run_dir: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    if len(data) < HEADER.size:
        return []
    out = []
    for payload in _payloads(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        out.append(record)
    return out


def history(run_dir: Path) -> list[dict[str, Any]]:
    """The run's history rows, without wandb's own ``_step``/``_runtime``/``_timestamp`` keys."""
    rows = []
    for record in records(run_dir):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append({key: value for key, value in row.items() if not key.startswith("_")})
    return rows


def step_metrics(run_dir: Path) -> dict[str, str]:
    """``{metric name or glob: its x-axis metric}`` from the run's ``define_metric`` records."""
    axes = {}
    for record in records(run_dir):
        if record.WhichOneof("record_type") == "metric" and record.metric.step_metric:
            axes[record.metric.glob_name or record.metric.name] = record.metric.step_metric
    return axes
