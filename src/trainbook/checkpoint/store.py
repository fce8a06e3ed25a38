"""Checkpoints through torch.distributed.checkpoint (DCP), one directory per step.

    checkpoints/step-<N>/   DCP files (.metadata + shards), written as step-<N>.tmp then renamed
    checkpoints/latest      text file naming the newest complete checkpoint, replaced atomically

DCP is used even in one process so that the same files later load into any parallel layout.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainbook.atomic import atomic_write_text
from trainbook.config import CheckpointConfig
from trainbook.errors import TrainbookError

LATEST = "latest"


@contextlib.contextmanager
def _single_process_ok():
    # DCP warns that it assumes a single process when no process group exists: that is intended.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class Checkpointer:
    def __init__(self, root: Path, cfg: CheckpointConfig):
        self.root = Path(root)
        self.interval = cfg.interval_steps
        self.keep_last = cfg.keep_last

    def due(self, step: int, max_steps: int) -> bool:
        return step == max_steps or (self.interval > 0 and step % self.interval == 0)

    def save(self, step: int, state: dict) -> Path:
        """Write `state` (nested dicts of tensors) as checkpoint `step`, then point `latest` at it."""
        final = self.root / f"step-{step}"
        tmp = self.root / f"step-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crash while writing
        tmp.mkdir(parents=True)
        with _single_process_ok():
            dcp.save(state, checkpoint_id=tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(self.root / LATEST, final.name + "\n")
        self._prune()
        return final

    def _prune(self) -> None:
        complete = sorted(
            (p for p in self.root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()),
            key=lambda p: int(p.name[5:]),
        )
        for old in complete[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(checkpoints: Path) -> Path | None:
    pointer = Path(checkpoints) / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / ".metadata").is_file() else None


def load_state(path: Path, state: dict) -> None:
    """Fill `state` (same nesting as saved, tensors pre-allocated) in place from checkpoint `path`."""
    if not (Path(path) / ".metadata").is_file():
        raise TrainbookError("not a trainbook checkpoint (no DCP .metadata)", where=str(path))
    # trainbook checkpoints hold tensors only; DCP would unpickle any other object it finds.
    metadata = dcp.FileSystemReader(path).read_metadata()
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise TrainbookError(f"holds a pickled object at {key!r}; refusing to unpickle it", where=str(path))
    with _single_process_ok():
        dcp.load(state, checkpoint_id=path)


def locate(target: Path) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) for a run directory or a checkpoint directory."""
    target = Path(target)
    if (target / ".metadata").is_file():
        return target.parent.parent, target
    if (target / "config.resolved.toml").is_file():
        ckpt = latest_checkpoint(target / "checkpoints")
        if ckpt is None:
            raise TrainbookError("run has no complete checkpoint yet", where=str(target))
        return target, ckpt
    raise TrainbookError("neither a run directory nor a checkpoint", where=str(target))
