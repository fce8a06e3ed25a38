"""Reading checkpoints: which one `latest` names, verifying a manifest, the newest valid one,
and loading tensors into a state. `.metadata` (a pickle) is read only by `metadata.py`'s
allow-list unpickler, so opening a checkpoint runs no code. Written by `store.py`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainbook.checkpoint.metadata import SafeReader, read_metadata
from trainbook.checkpoint.store import (
    LATEST, MANIFEST, InvalidCheckpoint, file_crc32, no_dist, single_process_ok, step_of,
)
from trainbook.config import dotted_keys as flatten  # nested state -> the keys DCP stores
from trainbook.errors import TrainbookError
from trainbook.runs import RunPaths

def read_latest(root: Path) -> int | None:
    """The step `latest` names, or None when there is no (readable) pointer."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    return step_of(Path(pointer.read_text().strip()))


def verify(path: Path) -> dict:
    """The manifest of checkpoint `path` after checking every file it lists; InvalidCheckpoint if not."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidCheckpoint("no manifest.json (not a committed checkpoint)") from None
    except (OSError, ValueError) as e:
        raise InvalidCheckpoint(f"manifest.json is unreadable: {e}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or ".metadata" not in files:
        raise InvalidCheckpoint("manifest.json lists no files (or no .metadata)")
    root = path.resolve()
    for name, entry in files.items():
        target = (path / name).resolve()
        if Path(name).is_absolute() or ".." in Path(name).parts or root not in target.parents:
            raise InvalidCheckpoint(f"manifest.json names a path outside the checkpoint: {name!r}")
        if not target.is_file():
            raise InvalidCheckpoint(f"{name} is missing")
        size = target.stat().st_size
        if size != entry.get("size"):
            raise InvalidCheckpoint(f"{name} has {size} bytes, the manifest says {entry.get('size')}")
        if file_crc32(target) != entry.get("crc32"):
            raise InvalidCheckpoint(f"{name} fails its checksum (corrupted)")
    return manifest


def newest_valid(root: Path, on_skip: Callable[[Path, str], None],
                 at_most: int | None = None) -> tuple[Path, dict] | None:
    """The newest committed checkpoint that verifies (of step `at_most` or earlier, when given),
    skipping (and reporting) broken ones."""
    root = Path(root)
    if not root.is_dir():
        return None
    latest = read_latest(root)
    steps = sorted((s for s in map(step_of, root.iterdir()) if s is not None), reverse=True)
    for step in steps:
        if latest is not None and step > latest:
            continue  # written but never committed: the crash came before `latest` moved
        if at_most is not None and step > at_most:
            continue
        path = root / f"step-{step}"
        try:
            return path, verify(path)
        except InvalidCheckpoint as e:
            on_skip(path, str(e))
    return None


def latest_checkpoint(root: Path) -> Path | None:
    """The committed checkpoint `latest` names, without verifying it (cheap; for tools)."""
    step = read_latest(root)
    path = Path(root) / f"step-{step}"
    return path if step is not None and (path / ".metadata").is_file() else None


def tensor_entries(path: Path) -> dict[str, TensorStorageMetadata]:
    """DCP's flat key -> tensor metadata (global shape, dtype); refuses pickled entries."""
    if not (Path(path) / ".metadata").is_file():
        raise TrainbookError("not a trainbook checkpoint (no DCP .metadata)", where=str(path))
    metadata = read_metadata(Path(path) / ".metadata")
    for key, item in metadata.state_dict_metadata.items():
        # trainbook checkpoints hold tensors only; DCP would torch.load (unpickle) any other object.
        if not isinstance(item, TensorStorageMetadata):
            raise TrainbookError(f"holds a pickled object at {key!r}; refusing to unpickle it", where=str(path))
    return dict(metadata.state_dict_metadata)


def load_state(path: Path, state: dict) -> None:
    """Fill `state` (same nesting as saved, tensors pre-allocated) in place from checkpoint `path`.

    Shapes are checked first, so a checkpoint of another model fails with the tensor's name and
    both shapes instead of a DCP traceback.
    """
    entries = tensor_entries(path)
    for key, tensor in flatten(state).items():
        if key not in entries:
            raise TrainbookError(f"has no tensor {key!r}", where=str(path))
        if tuple(entries[key].size) != tuple(tensor.shape):
            raise TrainbookError(
                f"{key}: checkpoint has shape {tuple(entries[key].size)}, this run has {tuple(tensor.shape)}",
                where=str(path),
            )
    with single_process_ok():
        # DCP reads .metadata again itself: through the same allow-list.
        dcp.load(state, storage_reader=SafeReader(path), no_dist=no_dist())


def locate(target: Path) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) for a run directory or a checkpoint directory.

    A run directory means its newest checkpoint that verifies; a checkpoint directory must verify.
    """
    target = Path(target)
    if (target / ".metadata").is_file():
        try:
            verify(target)
        except InvalidCheckpoint as e:
            raise TrainbookError(f"checkpoint is not valid: {e}", where=str(target)) from None
        return target.parent.parent, target
    run = RunPaths.of(target)
    if run.config.is_file():
        found = newest_valid(run.checkpoints, on_skip=lambda path, why: None)
        if found is None:
            raise TrainbookError("run has no valid checkpoint yet", where=str(target))
        return target, found[0]
    raise TrainbookError("neither a run directory nor a checkpoint", where=str(target))
