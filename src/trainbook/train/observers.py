"""Observers: what watches a step without changing it, behind one small protocol.

The loop calls one `Observers` at fixed moments and never asks who listens; the step
(train/step.py) calls the same object at its own points. An observer reads, measures and
records: no number of the step changes because one listens (tests/e2e: layer statistics and
straggler probes on and off, bitwise). The moments, in the order a step meets them:

- `before_step(step)`: the step is about to start (arm what this step measures);
- `at(point)`: inside the step, at "start", after each micro-batch's "data", after backward
  ("compute"): every rank meets there (the straggler probes);
- `observe_grads()`: gradients final (reduced, unscaled), not yet clipped;
- `before_update()`: just before the optimizer changes any state;
- `after_step(step)`: the step's record is out (what is measured here is in no step's time);
- `end(status)`: the run ended ("finished", "stopped", "failed");
- `close()`: release what the observer holds.

| observer | what it implements |
|---|---|
| `CheckpointStaging` | before_update: an async save still copying the last step's state is waited for |
| `LayerStatsObserver` | before_step (arm), observe_grads, before_update (weights' copy), after_step (report) |
| `ProfilerObserver` | before_step / after_step: the torch.profiler trace of `train.profile_steps`, close |
| `HealthObserver` | end: health.json's final state (its phase is kept by the tracker's boundary hook) |
| `StragglerObserver` | before_step (probed or not), at: the probes; the figures the report gathers |
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from trainbook.checkpoint import Checkpointer
from trainbook.diagnose.layers import LayerStats
from trainbook.diagnose.profile import StepProfiler
from trainbook.monitor import Monitors
from trainbook.monitor.health import HealthFile
from trainbook.monitor.report import RankTimes
from trainbook.phase import Phase, PhaseTracker
from trainbook.train.stragglers import StragglerProbes


class StepObserver:
    """The protocol, every moment a no-op: an observer overrides the moments it needs."""

    def before_step(self, step: int) -> None:
        pass

    def at(self, point: str) -> None:
        pass

    def observe_grads(self) -> None:
        pass

    def before_update(self) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def end(self, status: str) -> None:
        pass

    def close(self) -> None:
        pass


NO_OBSERVER = StepObserver()


class Observers(StepObserver):
    """Several observers as one, called in the order given (closed in the reverse order, each
    even when one before it fails)."""

    def __init__(self, *observers: StepObserver):
        self.observers = observers

    def before_step(self, step: int) -> None:
        for o in self.observers:
            o.before_step(step)

    def at(self, point: str) -> None:
        for o in self.observers:
            o.at(point)

    def observe_grads(self) -> None:
        for o in self.observers:
            o.observe_grads()

    def before_update(self) -> None:
        for o in self.observers:
            o.before_update()

    def after_step(self, step: int) -> None:
        for o in self.observers:
            o.after_step(step)

    def end(self, status: str) -> None:
        for o in self.observers:
            o.end(status)

    def close(self) -> None:
        with contextlib.ExitStack() as stack:
            for o in self.observers:
                stack.callback(o.close)


class CheckpointStaging(StepObserver):
    def __init__(self, checkpointer: Checkpointer, tracker: PhaseTracker):
        self.checkpointer, self.tracker = checkpointer, tracker

    def before_update(self) -> None:
        self.tracker.enter(Phase.CHECKPOINT, detail="waiting for the checkpoint copy")
        self.checkpointer.wait_staged()


class LayerStatsObserver(StepObserver):
    """Per-layer statistics on every `monitor.layer_stats_every`-th step (diagnose/layers.py),
    reduced after the step's record so that they are in no step's time."""

    def __init__(self, stats: LayerStats, tracker: PhaseTracker, monitors: Monitors):
        self.stats, self.tracker, self.monitors = stats, tracker, monitors
        self.due = False

    def before_step(self, step: int) -> None:
        self.due = self.stats.due(step)
        if self.due:
            self.stats.arm()

    def observe_grads(self) -> None:
        if self.due:
            self.tracker.enter(Phase.GRAD_SYNC, detail="layer statistics")
            self.stats.observe_grads()

    def before_update(self) -> None:
        self.stats.before_update()  # a copy of the weights when armed

    def after_step(self, step: int) -> None:
        if self.due:
            layers = self.stats.finish(step)
            if layers is not None:
                self.monitors.on_layers(layers)

    def close(self) -> None:
        self.stats.close()


class ProfilerObserver(StepObserver):
    def __init__(self, profiler: StepProfiler):
        self.profiler = profiler

    def before_step(self, step: int) -> None:
        self.profiler.before_step(step)

    def after_step(self, step: int) -> None:
        self.profiler.after_step(step)

    def close(self) -> None:
        self.profiler.close()


class HealthObserver(StepObserver):
    def __init__(self, health: HealthFile):
        self.health = health

    def end(self, status: str) -> None:
        self.health.set_state(status)


class StragglerObserver(StepObserver):
    """The straggler probes (train/stragglers.py) on the steps `probed(step)` says, every rank
    agreeing; the step's report gathers their `figures` with every rank's."""

    def __init__(self, probes: StragglerProbes, probed: Callable[[int], bool]):
        self.probes, self.probed = probes, probed
        self.active = False

    def before_step(self, step: int) -> None:
        self.active = self.probed(step)

    def at(self, point: str) -> None:
        if self.active:
            self.probes(point)

    def figures(self, phases: dict[str, float]) -> list[float]:
        return self.probes.figures(phases) if self.active else []

    def rank_times(self, step_times: list[float], rows: list[list[float]]) -> RankTimes:
        return self.probes.rank_times(step_times, rows)


class RerunObserver(StepObserver):
    """A bad step's re-run (triage): the run's update-time observers, and `observe` (every
    block's gradient norm) for the gradients; nothing else of the first attempt's."""

    def __init__(self, run: StepObserver, observe: Callable[[], None], tracker: PhaseTracker):
        self.run, self.observe, self.tracker = run, observe, tracker

    def observe_grads(self) -> None:
        self.tracker.enter(Phase.GRAD_SYNC, detail="layer statistics")
        self.observe()

    def before_update(self) -> None:
        self.run.before_update()
