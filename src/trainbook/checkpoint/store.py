"""Checkpoints through torch.distributed.checkpoint (DCP): atomic, verified, retained, async.

    checkpoints/step-<N>/        DCP files (.metadata + one shard file per rank) + manifest.json
    checkpoints/step-<N>.tmp/    a checkpoint being written; never read
    checkpoints/latest           names the newest committed checkpoint; replaced atomically

A save commits in this order, so a crash at any instant leaves the previous checkpoint valid and
selected: DCP writes (and fsyncs) the shards into `step-<N>.tmp/`; each rank checksums its own
files; rank 0 writes `manifest.json` (files, sizes, CRC-32s, step, config, layout, versions),
renames the directory to `step-<N>/`, then points `latest` at it. `latest` is the commit: a
`step-<N>/` newer than it is the leftover of a crash and is ignored. Loading verifies the manifest
first; a corrupted checkpoint is skipped (the caller logs why) and the next older one is used.

DCP is used even in one process so that the same files later load into any parallel layout.
CRC-32 detects corruption (truncation, flipped bytes); it is not a defence against tampering,
which is why loading also refuses any pickled entry.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import uuid
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from trainbook.atomic import atomic_write_json, atomic_write_text, fsync_dir
from trainbook.config import CheckpointConfig
from trainbook.faults import fault_point

LATEST = "latest"
MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 8 << 20
_SIDECAR = ".files-rank{}.json"  # one rank's file list, merged by rank 0 into the manifest


class InvalidCheckpoint(Exception):
    """A checkpoint that fails verification; the message says why."""


@contextlib.contextmanager
def single_process_ok():
    """DCP warns that it assumes a single process when no process group exists: that is intended,
    and silenced inside this block."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def no_dist() -> bool:
    """No process group: DCP saves and loads in this process alone (its `no_dist`)."""
    return not (dist.is_available() and dist.is_initialized())


def file_crc32(path: Path) -> str:
    crc = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


class _ChecksummingStream:
    """A write stream that computes the CRC-32 of what passes through it (DCP writes sequentially)."""

    def __init__(self, raw):
        self._raw = raw
        self.crc = 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return self._raw.write(data)

    def flush(self) -> None:
        if not self._raw.closed:  # torch's writer may flush after DCP has closed the file
            self._raw.flush()

    def __getattr__(self, name):  # tell, fileno, closed, ...
        return getattr(self._raw, name)


class _ChecksummingFileSystem(dcp.filesystem.FileSystem):
    """DCP's local filesystem, noting each written file's CRC-32 so nothing is read back to hash it."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step
        self.crcs: dict[str, str] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _ChecksummingStream(raw)
            yield stream
            # A shard is written, the checkpoint is not: crash tests die here in the middle of a
            # save (in async mode on DCP's writer thread, while training goes on).
            fault_point("checkpoint.writing", self.step)
        with self._lock:  # DCP's writer threads each write their own files
            self.crcs[Path(path).name] = f"{stream.crc:08x}"

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.crcs:
                self.crcs[Path(new_path).name] = self.crcs.pop(Path(path).name)


def _writer(path: Path, step: int) -> dcp.FileSystemWriter:
    # Two writer threads: serialising, checksumming and fsyncing one file overlaps the other's.
    writer = dcp.FileSystemWriter(path, sync_files=True, thread_count=2)
    writer.fs = _ChecksummingFileSystem(step)
    return writer


def step_of(path: Path) -> int | None:
    """N for a committed `step-N` directory name, else None (temp dirs, trash, files)."""
    name = Path(path).name
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


class Checkpointer:
    """Saves checkpoints of one run; every rank makes one, rank 0 commits.

    `on_commit(step, path, seconds)` is called once a checkpoint is committed (on rank 0; in
    async mode from the background thread that finishes the save).
    """

    def __init__(
        self,
        root: Path,
        cfg: CheckpointConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        describe: dict | None = None,
        on_commit: Callable[[int, Path, float], None] | None = None,
    ):
        self.root = Path(root)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.describe = describe or {}
        self.on_commit = on_commit
        self._last_save = time.monotonic()
        self._in_flight: Future | None = None
        self._in_flight_step: int | None = None
        # Async: the stager copies the state aside in its own thread (into CPU buffers it keeps
        # between saves, pinned when an accelerator is there); one more thread finishes the save.
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if cfg.mode == "async" else None
        self._stager = (
            DefaultStager(StagingOptions(torch.accelerator.is_available(), False, True, False))
            if cfg.mode == "async" else None
        )
        self._staging: Future | None = None
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-retention")
        # torch.save (inside DCP) computes a CRC-32 of every record that nothing here reads: the
        # manifest's CRC-32 covers every byte already. Process-wide, since async saves run in a thread.
        torch.serialization.set_crc32_options(False)
        if cfg.mode == "async" and no_dist():
            # The upload thread runs outside single_process_ok(); one process is intended there too.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    # ---- when -------------------------------------------------------------------------------

    def due(self, step: int, max_steps: int) -> bool:
        """Save now? At the end, every `interval_steps`, and after `interval_minutes`."""
        if step == max_steps or (self.cfg.interval_steps and step % self.cfg.interval_steps == 0):
            return True
        if not self.cfg.interval_minutes:
            return False
        late = time.monotonic() - self._last_save >= self.cfg.interval_minutes * 60
        return any_rank(late)  # clocks differ: every rank must take the same decision

    # ---- save -------------------------------------------------------------------------------

    def save(self, step: int, state: dict, info: dict | None = None) -> Path:
        """Write `state` (nested dicts of tensors) as checkpoint `step`.

        Sync mode returns once the checkpoint is committed. Async mode returns at once: the state
        is copied aside in the background, and the caller must call `wait_staged()` before it
        next changes the state (the optimizer step); the write and the commit follow in the
        background. Returns the path the checkpoint has (or will have) once committed.
        """
        self.wait()  # at most one save in flight
        self._last_save = time.monotonic()
        tmp = self.root / f"step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crash while writing
            tmp.mkdir(parents=True)
        _barrier()  # the directory exists before any rank writes into it
        writer = _writer(tmp, step)
        started = time.perf_counter()
        info = dict(info or {})
        with single_process_ok():
            if self._finisher is None:
                dcp.save(state, storage_writer=writer, no_dist=no_dist())
                self._commit(step, tmp, writer.fs.crcs, info, started)
            else:
                self._staging = Future()
                self._in_flight = self._finisher.submit(self._save_in_background, state, writer, self._staging,
                                                        step, tmp, info, started)
                self._in_flight_step = step
        return self.root / f"step-{step}"

    def wait_staged(self) -> None:
        """Block until the save in flight has copied the state aside (a no-op in sync mode)."""
        if self._staging is not None:
            staging, self._staging = self._staging, None
            staging.result()

    def wait(self) -> Path | None:
        """Block until the save in flight (async mode) is committed; re-raise its error."""
        self.wait_staged()
        if self._in_flight is None:
            return None
        future, step = self._in_flight, self._in_flight_step
        self._in_flight = self._in_flight_step = None
        future.result()
        return self.root / f"step-{step}"

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None and not self._in_flight.done()

    def _save_in_background(self, state: dict, writer: dcp.FileSystemWriter, staged: Future, step: int,
                            tmp: Path, info: dict, started: float) -> None:
        # All of dcp.async_save (planning, handing the state to the stager) runs here, off the
        # training thread; `staged` tells that thread when the state has been copied aside.
        try:
            response = dcp.async_save(state, storage_writer=writer, async_stager=self._stager, no_dist=no_dist())
            response.staging_completion.result()
        except BaseException as e:
            staged.set_exception(e)
            raise
        staged.set_result(None)
        response.upload_completion.result()
        self._commit(step, tmp, writer.fs.crcs, info, started)

    def _commit(self, step: int, tmp: Path, crcs: dict[str, str], info: dict, started: float) -> None:
        files = self._own_files(tmp, crcs)
        if self.world_size > 1:
            atomic_write_json(tmp / _SIDECAR.format(self.rank), files)
            if self.rank != 0:
                return
            files = self._gather_file_lists(tmp)
        fault_point("checkpoint.before_manifest", step)
        manifest = {
            "format": FORMAT, "step": step, "time": time.time(), "checksum": "crc32",
            "files": files, "world_size": self.world_size, **self.describe, **info,
        }
        atomic_write_json(tmp / MANIFEST, manifest)
        fault_point("checkpoint.before_rename", step)
        final = self.root / f"step-{step}"
        if final.exists():  # an uncommitted leftover of a crashed run reaching the same step
            self._trash(final).result()
        os.replace(tmp, final)
        fsync_dir(self.root)
        fault_point("checkpoint.before_latest", step)
        atomic_write_text(self.root / LATEST, final.name + "\n")
        self._prune(keep=step)
        if self.on_commit is not None:
            self.on_commit(step, final, time.perf_counter() - started)
        fault_point("checkpoint.after_commit", step)

    def _own_files(self, tmp: Path, crcs: dict[str, str]) -> dict[str, dict]:
        """Size and CRC-32 (noted while writing; read back only if missing) of this rank's files."""
        # DCP names each rank's shard files "__<rank>_<i>.distcp"; rank 0 also writes .metadata.
        own = [p for p in sorted(tmp.iterdir())
               if p.name.startswith(f"__{self.rank}_") or (self.rank == 0 and p.name == ".metadata")]
        return {p.name: {"size": p.stat().st_size, "crc32": crcs.get(p.name) or file_crc32(p)} for p in own}

    def _gather_file_lists(self, tmp: Path, timeout_s: float = 600.0) -> dict[str, dict]:
        # DCP's save returns on rank 0 only after every rank has written; their sidecars follow
        # within the time it takes them to checksum their own files.
        deadline = time.monotonic() + timeout_s
        files: dict[str, dict] = {}
        for rank in range(self.world_size):
            sidecar = tmp / _SIDECAR.format(rank)
            while not sidecar.is_file():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank} did not list its checkpoint files in {sidecar}")
                time.sleep(0.05)
            files.update(json.loads(sidecar.read_text()))
        return files

    # ---- retention ------------------------------------------------------------------------

    def _prune(self, keep: int) -> None:
        """Delete committed checkpoints outside keep_last / keep_every, in the background."""
        committed = sorted(s for s in map(step_of, self.root.iterdir()) if s is not None and s <= keep)
        kept = set(committed[-self.cfg.keep_last:]) | {keep}
        if self.cfg.keep_every:
            kept |= {s for s in committed if s % self.cfg.keep_every == 0}
        for s in committed:
            if s not in kept:
                self._trash(self.root / f"step-{s}")

    def _trash(self, path: Path) -> Future:
        # Rename first (atomic), delete later: a half-deleted directory never looks like a checkpoint.
        trash = self.root / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
        os.replace(path, trash)
        return self._deleter.submit(shutil.rmtree, trash, True)

    def discard_uncommitted(self, resumed_step: int | None) -> None:
        """Before a run continues here: remove temp dirs, trash, and step dirs newer than `latest`."""
        if self.rank != 0 or not self.root.is_dir():
            return
        for path in self.root.iterdir():
            step = step_of(path)
            if path.name.endswith(".tmp") or path.name.startswith(".trash-"):
                self._deleter.submit(shutil.rmtree, path, True)
            elif step is not None and resumed_step is not None and step > resumed_step:
                self._trash(path)

    def roll_back_to(self, step: int) -> list[int]:
        """Training continues from checkpoint `step` (a triage rollback): the newer checkpoints
        belong to the abandoned trajectory, so they go and `latest` names `step` again. Returns
        the steps removed (rank 0; [] elsewhere)."""
        self.wait()
        if self.rank != 0:
            return []
        newer = sorted(s for s in map(step_of, self.root.iterdir()) if s is not None and s > step)
        for s in newer:
            self._trash(self.root / f"step-{s}")
        atomic_write_text(self.root / LATEST, f"step-{step}\n")
        return newer

    def close(self) -> None:
        """Wait for the save in flight and for background deletions."""
        try:
            self.wait()
        finally:
            if self._finisher is not None:
                self._finisher.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()
            self._deleter.shutdown(wait=True)


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank (a no-op in one process)."""
    if no_dist():
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _barrier() -> None:
    if not no_dist():
        dist.barrier()
