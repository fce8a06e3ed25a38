"""health.json: what the run is doing now, for a liveness probe and for the post-mortem (rank 0).

`{"state", "step", "phase", "since", "time", "attempt", "pid", "host"}`:

- `state`: `starting` (the process is up, before its first step), `training`, `checkpointing`,
  `restarting` (written by the elastic agent's recorder when a worker failed and the group is
  being restarted: commands/elastic.py), `finished`, `stopped` (by SIGTERM/SIGINT, after a
  checkpoint), `failed`;
- `step`: the step being run (or, in phase `idle`, the last step whose record is written: the
  run is between steps); `phase`: the phase entered and `since` the wall-clock time it was
  entered; `time`: when the file was written; `attempt`: the elastic attempt (the agent's restart
  count, 0 before any restart).

It is rewritten when a step begins, when the loop enters an evaluation or a checkpoint save, and
when a step's record is complete: a few small writes a step, never per micro-batch. What a killed
run leaves there is the last of these: `trainbook doctor` reads it as where the run was when it
died. Written by rename (readers never see half a file), without fsync: a killed process loses
nothing it wrote; only a lost machine could.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from trainbook.phase import Phase

# Phases whose entry is written; the step's inner phases (forward, backward...) are not.
WRITTEN = (Phase.EVALUATION, Phase.CHECKPOINT, Phase.IDLE)
STATES = ("starting", "training", "checkpointing", "restarting", "finished", "stopped", "failed")


def attempt() -> int:
    """This worker's elastic attempt: how many times the agent restarted the group before it."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def read_health(path: Path) -> dict:
    """health.json's record, or {} when there is none (or it cannot be read)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_health(path: Path, record: dict) -> None:
    """Replace health.json with `record` (plus `time`) by rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({**record, "time": time.time()}) + "\n")
    os.replace(tmp, path)


class HealthFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._last: Phase | None = None
        self._fixed = {"attempt": attempt(), "pid": os.getpid(), "host": socket.gethostname()}
        self._record: dict = {}

    def on_phase(self, phase: Phase, step: int, detail: str) -> None:
        """The tracker's boundary hook: write on a step's start (data after idle) and on WRITTEN
        phases (a checkpoint's in-step wait for the copy is not a save: not written)."""
        starts_step = phase is Phase.DATA and self._last in (None, Phase.IDLE)
        self._last = phase
        if starts_step or (phase in WRITTEN and not detail):
            self.write(phase, step)

    def write(self, phase: Phase, step: int, state: str | None = None) -> None:
        state = state or ("checkpointing" if phase is Phase.CHECKPOINT else "training")
        self._record = {"state": state, "step": step, "phase": phase.value, "since": time.time(), **self._fixed}
        write_health(self.path, self._record)

    def set_state(self, state: str) -> None:
        """`starting`, `finished`, `stopped` or `failed`: the state changes, where the run is stays."""
        assert state in STATES, state
        record = self._record or {"step": 0, "phase": Phase.IDLE.value, "since": time.time(), **self._fixed}
        self._record = {**record, "state": state}
        write_health(self.path, self._record)
