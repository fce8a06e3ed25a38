"""Steps that went wrong, and the one decision after every step.

NaN and loss-spike triage (diagnose/triage.py) judges a step inside it, before its update, on
every rank together; a rejected step is re-run on the same batches with every module watched,
written up as an incident, and then continued (transient), skipped, rolled back to a checkpoint
or stopped, as the policy says. An fp16 step whose gradients overflowed was skipped by the loss
scaler already and is recorded here. `decide` is the one place where how a step went changes
the course of the run.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable
from pathlib import Path

from trainbook.checkpoint import Checkpointer, any_rank, step_of
from trainbook.config import TriageConfig
from trainbook.data import TrainLoader
from trainbook.diagnose.triage import StepBatches, Triage
from trainbook.errors import NonFiniteFailure
from trainbook.monitor import StepReport
from trainbook.precision import LossScaler
from trainbook.runs import RunPaths
from trainbook.train.observers import RerunObserver, StepObserver
from trainbook.train.state import TrainState
from trainbook.train.step import Step, StepResult


class Decision(enum.Enum):
    """What the loop does after a step (`BadSteps.decide`)."""

    CONTINUE = "continue"
    SKIP = "skip"  # the step's update was dropped (fp16 overflow); training goes on
    STOP = "stop"  # save a checkpoint and stop (a signal reached some rank)
    FAIL = "fail"  # a bad step under triage policy `stop`: its record goes out, then the verdict (exit 5)


class BadSteps:
    def __init__(self, triage: Triage, cfg: TriageConfig, step: Step, batches: StepBatches, state: TrainState,
                 checkpointer: Checkpointer, loader: TrainLoader, scaler: LossScaler, observer: StepObserver, *,
                 paths: RunPaths, samples_per_step: int, emit: Callable[..., None], logger: logging.Logger,
                 message: Callable[[str], None]):
        self.triage, self.cfg, self.step, self.batches, self.state = triage, cfg, step, batches, state
        self.checkpointer, self.loader, self.scaler, self.observer = checkpointer, loader, scaler, observer
        self.paths, self.samples_per_step = paths, samples_per_step
        self.emit, self.logger, self.message = emit, logger, message
        self.failure: NonFiniteFailure | None = None  # set under policy stop; the loop ends with it

    def judge(self, lr: float) -> Callable[[float, float], object] | None:
        """The step's judge (None with triage off)."""
        return (lambda loss, norm: self.triage.judge(loss, norm, lr)) if self.triage.enabled else None

    def after(self, result: StepResult, judge, lr: float) -> StepResult | None:
        """A finished step's result as the run keeps it: a rejected one handled (None after a
        rollback), a clean one added to the spike rule's window."""
        if result.rejected is not None:
            return self._handle(result, judge, lr)
        if not result.skipped:
            self.triage.accept(result.loss, lr)
        return result

    def _handle(self, first: StepResult, judge, lr: float) -> StepResult | None:
        """A bad step, on every rank together (the re-run, the incident, the policy's verdict).
        Under `stop` the step's record still goes out before the run ends (Decision.FAIL)."""
        step = self.state.step + 1
        out = self.triage.handle(
            step, first, lr, self.batches, self.step.engine.model, self.step.engine.in_training_forward,
            rerun=lambda batches, observe: self.step(
                batches, RerunObserver(self.observer, observe, self.step.tracker), judge),
            wait_for_saves=self.checkpointer.wait,  # an async save of an earlier step is a checkpoint too
        )
        self.emit("incident", step, **out.event)
        if out.action == "stop":
            self.failure = NonFiniteFailure(out.line)
        else:
            self.logger.warning(out.line)
            self.message(f"triage: {out.line}")
        if out.action == "rollback":
            self._roll_back(out.rollback_to, step)
            return None
        if out.action == "skip":
            self.emit("skipped_step", step, reason=first.rejected.what, by="triage")
        if out.action == "continue":  # transient: the re-run's update was applied
            self.triage.accept(out.rerun.loss, lr)
        kept = out.rerun if out.action == "continue" else first
        return dataclasses.replace(kept, phases={k: v + out.rerun.phases[k] for k, v in first.phases.items()})

    def _roll_back(self, target: Path, bad_step: int) -> None:
        """Continue from checkpoint `target` and never read the next `rollback_skip_batches`
        batches of data after it; newer checkpoints belong to the abandoned trajectory."""
        removed = self.checkpointer.roll_back_to(step_of(target))
        self.state.load(target)
        start = self.loader.consumed
        end = start + self.cfg.rollback_skip_batches * self.samples_per_step
        self.loader.skip(start, end)
        self.triage.rollbacks += 1
        self.emit("rollback", bad_step, to_step=self.state.step, path=self.paths.name(target),
                  skipped_samples=[start, end], skipped_batches=self.cfg.rollback_skip_batches,
                  removed_checkpoints=removed)

    def decide(self, report: StepReport, stop_requested: bool) -> Decision:
        """Every rank reaches the same decision (`any_rank` is a collective): stop when a signal
        reached any rank; an overflowed fp16 step is recorded; triage's `stop` ends the run,
        once the step's record is out."""
        if self.failure is not None:  # every rank's triage reached it together
            return Decision.FAIL
        if any_rank(stop_requested):
            return Decision.STOP
        if report.skipped:
            self.emit("skipped_step", report.step, reason="gradient overflow (inf/NaN)",
                      loss_scale=report.loss_scale, next_loss_scale=self.scaler.scale_value,
                      skipped_total=self.scaler.skipped)
            self.logger.warning(f"step {report.step}: gradients overflowed at loss scale {report.loss_scale:g}; "
                                f"step skipped, scale -> {self.scaler.scale_value:g}")
            return Decision.SKIP
        return Decision.CONTINUE
