"""The phase profile: where a step's time goes, measured truthfully on any device.

Two tools, both fed by the phase tracker's boundary hook (trainbook/phase.py):

- `device_sync(device)`: with `train.profile_phases`, the device is synchronised at every phase
  boundary, so the kernels a phase queued are counted in that phase. Without it, an accelerator's
  time lands wherever the host next waits (usually the loss report, `grad_sync`); on the CPU
  every op runs on the calling thread and there is nothing to wait for.
- `StepProfiler`: `train.profile_steps = [a, b]` runs `torch.profiler` from the start of step a
  to the end of step b's record (its evaluation and checkpoint included) and writes a
  Chrome/Perfetto trace to `profile/rank<R>-steps-a-b.json`. Each phase is a
  `record_function` range named `phase/<name>` around the ops it ran.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from trainbook.phase import Phase


def device_sync(device: torch.device) -> Callable[[], None] | None:
    """A function that waits for all work queued on `device`; None on the CPU (none is queued)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "npu":
        return lambda: torch.npu.synchronize(device)
    return None


Boundary = Callable[[Phase, int, str], None]


def phase_boundary(*hooks: Boundary | None) -> Boundary | None:
    """One boundary hook running `hooks` in order (the synchronisation first); None if none is set."""
    active = [h for h in hooks if h is not None]
    if not active:
        return None
    if len(active) == 1:
        return active[0]

    def boundary(phase: Phase, step: int, detail: str) -> None:
        for hook in active:
            hook(phase, step, detail)

    return boundary


class StepProfiler:
    """`torch.profiler` over steps `first`..`last` (1-based, inclusive) on one rank; the trace
    goes into `folder` (the run's `profile/`)."""

    def __init__(self, folder: Path, rank: int, steps: tuple[int, int], device: torch.device):
        self.first, self.last = steps
        self.path = Path(folder) / f"rank{rank}-steps-{self.first}-{self.last}.json"
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._activities = activities
        self._prof: profile | None = None
        self._range: record_function | None = None
        self.done = False

    def before_step(self, step: int) -> None:
        """Step `step` is about to begin: start recording if it is the first profiled one (or a
        resumed run starts inside the window)."""
        if self._prof is None and not self.done and self.first <= step <= self.last:
            self._prof = profile(activities=self._activities)
            self._prof.start()

    def on_phase(self, phase: Phase, step: int, detail: str) -> None:
        """Tracker boundary hook: close the previous phase's range, open `phase`'s."""
        if self._prof is None:
            return
        self._close_range()
        if phase is not Phase.IDLE:
            self._range = record_function(f"phase/{phase.value}")
            self._range.__enter__()

    def after_step(self, step: int) -> Path | None:
        """Step `step`'s record is complete: stop and write the trace after the last profiled step."""
        if self._prof is None or step < self.last:
            return None
        return self._finish()

    def close(self) -> None:
        """The run ends inside the window (stopped early): keep what was recorded."""
        if self._prof is not None:
            self._finish()

    def _close_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def _finish(self) -> Path:
        self._close_range()
        prof, self._prof, self.done = self._prof, None, True
        prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        prof.export_chrome_trace(str(tmp))
        tmp.replace(self.path)  # readers never see half a trace
        return self.path
