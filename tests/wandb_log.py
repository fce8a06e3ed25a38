"""Reading what W&B logged offline, from its transaction log (`run-<id>.wandb`), with W&B's own
protobuf definitions: the tests compare it with metrics.jsonl."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32768


def wandb_records(path: Path) -> Iterator:
    """The records of a transaction log: a 7-byte W&B header, then LevelDB-log chunks (crc32c,
    length, type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, parts = 7, []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding up to the end of the block
            pos += BLOCK - pos % BLOCK
            continue
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def wandb_history(path: Path) -> dict[str, dict[int, float]]:
    """key -> {step: value} of every history row in the transaction log at `path`."""
    out: dict[str, dict[int, float]] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)  # the writer fills one or the other
                out.setdefault(key, {})[record.history.step.num] = json.loads(item.value_json)
    return out
