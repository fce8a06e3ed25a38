"""Atomic file writes: readers see the old file or the whole new one, never a part.

A leaf module (standard library only) shared by every package that writes state to disk.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    path = Path(path)
    # Host and pid in the temp name: ranks writing into a shared directory never share one.
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # The rename itself lives in the directory: sync it too, or a crash can forget it.
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in directory `path` durable."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: dict, indent: int = 1) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")
