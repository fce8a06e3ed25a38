"""Where in the step memory grows: the leak detector's evidence.

The process's current memory (the resident set on CPU, the allocator's live bytes on
accelerators: parallel/device.py `MemoryGauge`, a few microseconds) is read at every phase change
of the phase tracker. Per step, each phase is given the part of the step's growth it left behind
(`retained_by_phase`): activations that forward allocates and backward frees count for neither,
a tensor kept alive from the data phase counts for data. The `memory_growth` alert
(monitor/alerts.py) sums these over its window and names the phase that grows.
"""

from __future__ import annotations

import torch

from trainbook.parallel.device import MemoryGauge
from trainbook.phase import Phase, PhaseState, PhaseTracker

BETWEEN = "between steps"  # after the step's report: monitors, the loop itself
OWN_PHASES = (Phase.EVALUATION, Phase.CHECKPOINT)  # phases between steps that keep their names


def retained_by_phase(start: int, points: list[tuple[str, int]]) -> dict[str, int]:
    """Each phase's share of the memory that stays.

    `points`: (phase, memory at its end) in order, from memory `start`. The floor at a point is
    the lowest memory from there to the end; what a phase keeps is how much it raises the floor.
    Memory a phase takes and a later phase gives back raises no floor, what nothing gives back
    does. The shares are >= 0 and add up to the last reading minus the lowest one.
    """
    levels = [start, *(m for _, m in points)]
    floor = levels[:]
    for i in range(len(levels) - 2, -1, -1):
        floor[i] = min(levels[i], floor[i + 1])
    out: dict[str, int] = {}
    for i, (phase, _) in enumerate(points):
        out[phase] = out.get(phase, 0) + floor[i + 1] - floor[i]
    return out


class PhaseMemory:
    """Listens to `tracker`; `take()` at the end of each step returns the step's
    `retained_by_phase` (phase name -> bytes) since the previous `take()`."""

    def __init__(self, tracker: PhaseTracker, device: torch.device):
        self.tracker = tracker
        self.read = MemoryGauge(device)
        self._start = self.read()
        self._points: list[tuple[str, int]] = []
        self._between = False  # after take(), until the next step begins
        tracker.listen(self._on_phase)

    def _on_phase(self, left: PhaseState, entered: PhaseState) -> None:
        label = BETWEEN if self._between and left.phase not in OWN_PHASES else left.phase.value
        self._points.append((label, self.read()))
        if entered.step != left.step:
            self._between = False

    def take(self) -> dict[str, int]:
        end = self.read()
        points, self._points = self._points, []
        points.append((self.tracker.current().phase.value, end))
        start, self._start = self._start, end
        self._between = True
        return retained_by_phase(start, points)

    def close(self) -> None:
        self.read.close()
