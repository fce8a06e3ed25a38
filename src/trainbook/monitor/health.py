"""health.json: where the run is, rewritten as it moves between steps (rank 0).

`{"step", "phase", "since", "pid", "host"}`: the step being run (or, in phase `idle`,
the last step whose record is written: the run is between steps), the phase entered and the
wall-clock time it was entered. It is rewritten when a step begins, when the loop enters an
evaluation or a checkpoint save, and when a step's record is complete: a few small writes a step,
never per micro-batch. What a killed run leaves there is the last of these: `trainbook doctor`
reads it as where the run was when it died. Written by rename (readers never see half a file),
without fsync: a killed process loses nothing it wrote; only a lost machine could.
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


class HealthFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._last: Phase | None = None
        self._fixed = {"pid": os.getpid(), "host": socket.gethostname()}

    def on_phase(self, phase: Phase, step: int, detail: str) -> None:
        """The tracker's boundary hook: write on a step's start (data after idle) and on WRITTEN
        phases (a checkpoint's in-step wait for the copy is not a save: not written)."""
        starts_step = phase is Phase.DATA and self._last in (None, Phase.IDLE)
        self._last = phase
        if starts_step or (phase in WRITTEN and not detail):
            self.write(phase, step)

    def write(self, phase: Phase, step: int) -> None:
        record = {"step": step, "phase": phase.value, "since": time.time(), **self._fixed}
        self._tmp.write_text(json.dumps(record) + "\n")
        os.replace(self._tmp, self.path)
