"""What each rank is doing now: the phase of the current step, readable from any thread.

The step writes it (`enter`) as it moves through a step: data, forward, backward, gradient sync,
optimizer; the loop writes checkpoint and evaluation around it. Readers on other threads (the
timeout explanation, and the watchdog, profiler and alerts that build on it) call `current()`,
which returns one immutable snapshot: phase, step, what is being waited on, and the monotonic time
of entry. The tracker also sums the time spent in each phase, for the step timing in
`metrics.jsonl` (`take_durations`): every moment from `begin_step` on belongs to exactly one
phase, so the parts add up to the time taken.

`boundary`, when set, is called on the stepping thread at every phase change before the clock is
read: the trainer injects a device synchronisation there (`train.profile_phases`), so that work
queued on an accelerator is counted in the phase that queued it rather than wherever the host
next waits, the profiler's phase ranges, and health.json. It is None otherwise: a phase change costs a lock.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class Phase(enum.Enum):
    IDLE = "idle"
    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"
    FORWARD_BACKWARD = "forward/backward"  # a pipeline schedule interleaves both
    GRAD_SYNC = "gradient sync"  # collectives between backward and the update
    OPTIMIZER = "optimizer"
    CHECKPOINT = "checkpoint"
    EVALUATION = "evaluation"


@dataclass(frozen=True)
class PhaseState:
    phase: Phase
    step: int
    """The step being run (1-based: the step that will exist once it finishes); 0 before the first."""
    since: float
    """`time.monotonic()` when this phase was entered."""
    detail: str = ""
    """What exactly: "gradient norm", "waiting for the checkpoint copy", ..."""


class PhaseTracker:
    def __init__(self, boundary: Callable[[Phase, int, str], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._state = PhaseState(Phase.IDLE, 0, time.monotonic())
        self._durations: dict[Phase, float] = {}
        self.boundary = boundary
        """Called with the phase being entered, its step and detail, at each change, before the
        clock is read."""
        self._listeners: list[Callable[[PhaseState, PhaseState], None]] = []

    def listen(self, fn: Callable[[PhaseState, PhaseState], None]) -> None:
        """Call `fn(left, entered)` at every `enter`, after the change, in the thread that enters:
        keep it cheap (diagnose/phase_memory.py reads memory there)."""
        self._listeners.append(fn)

    def current(self) -> PhaseState:
        """A snapshot, safe to read from any thread."""
        return self._state

    def begin_step(self, step: int) -> None:
        """Start step `step` in the data phase; time spent between steps is not the step's."""
        self.enter(Phase.DATA, step)
        with self._lock:
            self._durations = {}

    def enter(self, phase: Phase, step: int | None = None, detail: str = "", boundary: bool = True) -> None:
        """Leave the current phase (its time is added to its total) and enter `phase`. `boundary`
        False: without the boundary hook (a call from another thread than the step's, such as
        autograd's device thread, whose profiler ranges would not pair with the step's)."""
        if boundary and self.boundary is not None:
            self.boundary(phase, self._state.step if step is None else step, detail)
        now = time.monotonic()
        with self._lock:
            old = self._state
            self._durations[old.phase] = self._durations.get(old.phase, 0.0) + now - old.since
            self._state = new = PhaseState(phase, old.step if step is None else step, now, detail)
        for fn in self._listeners:
            fn(old, new)

    def take_durations(self) -> dict[Phase, float]:
        """Seconds spent in each phase since the last call (the current phase up to now); resets."""
        self.enter(self._state.phase, detail=self._state.detail)
        with self._lock:
            out, self._durations = self._durations, {}
        return out
