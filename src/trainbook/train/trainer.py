"""The Trainer: one loop that reads top-down, over parts built and handed in (train/build.py).

Data flows one way: each step produces a StepReport, the monitors consume it. What a step
computes is the objective's (train/objective.py), what watches it the observers'
(train/observers.py), what a bad step does the BadSteps' (train/bad_steps.py), where the run is
the TrainState's (train/state.py), how the step is timed and gathered the StepReports'
(train/reporting.py).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainbook.checkpoint import Checkpointer
from trainbook.diagnose.oom import OutOfMemory
from trainbook.diagnose.timeouts import explain_timeout
from trainbook.diagnose.triage import StepBatches
from trainbook.errors import one_line
from trainbook.faults import fault_point
from trainbook.model import num_params
from trainbook.monitor import EvalReport, Monitors, StepReport
from trainbook.parallel.runtime import Runtime
from trainbook.phase import Phase, PhaseTracker
from trainbook.runs import RunPaths
from trainbook.train.bad_steps import BadSteps, Decision
from trainbook.train.engine import LocalEngine
from trainbook.train.observers import Observers
from trainbook.train.reporting import StepReports
from trainbook.train.schedule import LRSchedule
from trainbook.train.settle import Settled
from trainbook.train.state import TrainState, process
from trainbook.train.step import Step, evaluate
from trainbook.train.warmup import compile_first


class Trainer:
    def __init__(self, settled: Settled, paths: RunPaths, rt: Runtime, *, tracker: PhaseTracker, step: Step,
                 schedule: LRSchedule, batches: StepBatches, val_batches: list, state: TrainState,
                 observers: Observers, bad: BadSteps, reports: StepReports, checkpointer: Checkpointer,
                 oom: OutOfMemory, logger: logging.Logger, events, monitors: Monitors,
                 closing: list[Callable[[], None]], notes: list[str], trainable: str):
        self.settled, self.cfg, self.paths, self.rt = settled, settled.cfg, paths, rt
        self.tracker, self.step, self.schedule, self.state = tracker, step, schedule, state
        self.batches, self.produced = batches, step.objective.produce(batches)
        self.val_batches, self.observers, self.bad, self.reports = val_batches, observers, bad, reports
        self.checkpointer, self.oom, self.logger, self.events, self.monitors = checkpointer, oom, logger, events, monitors
        self.closing, self.notes, self.trainable = closing, notes, trainable
        self.stop_signal: int | None = None  # set by SIGTERM/SIGINT; the loop saves and stops

    @property
    def model(self):
        return self.step.engine.model

    # ---- the loop ------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train to `train.max_steps` (or until SIGTERM/SIGINT); returns a summary of the run."""
        t = self.cfg.train
        self._announce()
        report, decision, last_eval = None, Decision.CONTINUE, None
        try:
            self._compile_first()
            last_eval = self._evaluate() if self.val_batches and self.state.step == 0 else None
            with self._signals_stop_the_loop():
                while self.state.step < t.last_step:
                    report = self.advance()
                    if report is None:  # rolled back (triage): on from the checkpoint
                        continue
                    decision = self.bad.decide(report, self.stop_signal is not None)
                    save = decision is Decision.STOP or (decision is not Decision.FAIL
                                                         and self.checkpointer.due(self.state.step, t.last_step))
                    if self.state.outer is not None and decision is not Decision.FAIL:
                        self._outer_step(force=save or self.state.step == t.last_step)
                    if self.val_batches and (self.state.step % t.eval_every == 0 or self.state.step == t.last_step):
                        last_eval = self._evaluate()
                    if save:
                        self._save_checkpoint()
                    report = self.publish(report)  # its record covers the eval and checkpoint above
                    if decision is Decision.FAIL:
                        raise self.bad.failure
                    if decision is Decision.STOP:
                        self._on_stop()
                        break
                    fault_point("train.after_step", self.state.step)
                self.tracker.enter(Phase.CHECKPOINT)
                self.checkpointer.wait()  # an async save still in flight is part of the run
                self.tracker.enter(Phase.IDLE)
        except BaseException as e:
            self._failed(e)
            raise
        return self._finished(decision, report, last_eval)

    def advance(self) -> StepReport | None:
        """One optimizer step: set the LR, run the step, count. Its report goes to the monitors
        once what follows the step (evaluation, checkpoint) is timed too (`publish`). None: the
        step was bad and the run rolled back to a checkpoint (triage)."""
        lr = self.schedule(self.state.step)
        for group in self.step.optimizer.param_groups:
            group["lr"] = lr
        step = self.state.step + 1
        self.observers.before_step(step)
        self.reports.start()
        self.tracker.begin_step(step)
        self.batches.begin()
        judge = self.bad.judge(lr)
        try:
            result = self.bad.after(self.step(self.produced, self.observers, judge), judge, lr)
        except RuntimeError as e:  # a collective that timed out: one line naming the rank and the wait
            raise explain_timeout(e, self.tracker.current(), self.rt.rank, self.cfg.parallel.timeout_s) from e
        if result is None:
            return None
        self.state.step = step
        self.state.tokens += self.settled.tokens_per_step  # a skipped step consumed its data too
        return self.reports.measure(step, self.state.tokens, lr, result)

    def publish(self, report: StepReport) -> StepReport:
        """The step's record, timed to now, to the monitors; then what observes it after its time."""
        report = self.reports.settle(report)
        self.monitors.on_step(report)  # read-only consumers of the report
        self.observers.after_step(self.state.step)
        return report

    def _failed(self, e: BaseException) -> None:
        """Out of memory here or on a peer: the breakdown, the event and the one-line verdict
        (raised in place of `e`); every failure: the end marker `trainbook runs` reads (a
        SIGKILL leaves none, see monitor/archive.py)."""
        diagnosed = self.oom.diagnose(e, self.tracker.current()) if isinstance(e, Exception) else None
        failure = diagnosed or e
        self.events.emit("end", self.state.step, status="failed", error=f"{type(failure).__name__}: {one_line(failure)}")
        self.observers.end("failed")
        if diagnosed is not None:
            raise diagnosed from e

    def _finished(self, decision: Decision, report: StepReport | None, last_eval: float | None) -> dict:
        status = "stopped" if decision is Decision.STOP else "finished"
        self.events.emit("end", self.state.step, status=status)
        self.observers.end(status)
        return {"step": self.state.step, "tokens": self.state.tokens, "loss": report.loss if report else None,
                "val_loss": last_eval, "run_dir": str(self.paths.root),
                "stopped_by": signal.Signals(self.stop_signal).name if self.stop_signal else None}

    def _announce(self) -> None:
        t, dims, s = self.cfg.train, self.rt.dims, self.settled
        layout = dims.label() or "one process"
        pairs = " pairs x 2 rows" if self.cfg.dpo_enabled else ""
        self._message(
            f"run {self.paths.root} | model {self.cfg.model.name}: {num_params(self.model):,} parameters "
            f"(this rank) | {t.max_steps} steps x {s.tokens_per_step:,} tokens ({s.accum_steps} x "
            f"{t.micro_batch_size}{pairs} x {t.seq_len} x {dims.dp} dp) | {layout} | device {self.rt.device}"
        )
        self._message(self.trainable)
        if s.peak is None:
            self.logger.warning(s.peak_note)
            self._message(f"warning: {s.peak_note}")
        else:
            self.logger.info(s.peak_note)
        self.logger.info(s.compiling.reason)
        self._message(s.compiling.reason)
        for note in self.notes:
            self.logger.warning(note)
            self._message(f"warning: {note}")
        if self.state.step == 0:
            self.events.emit("start", self.state.step, tokens_per_step=s.tokens_per_step, **process())

    def _compile_first(self) -> None:
        """Compile before step 1 (train/warmup.py), so that no step's time holds the compile."""
        if not self.cfg.train.compile or not isinstance(self.step.engine, LocalEngine):
            return  # a pipeline compiles inside its first step (its schedule has no pass outside one)
        seconds = compile_first(self.step, self.cfg, evaluate=bool(self.val_batches))
        self.tracker.enter(Phase.IDLE)
        self.tracker.take_durations()
        self.events.emit("compiled", self.state.step, seconds=round(seconds, 3))
        self._message(f"compiled in {seconds:.1f} s (before step {self.state.step + 1}: in no step's time)")
        self.logger.info(f"compiled in {seconds:.1f} s")

    def _evaluate(self) -> float:
        val_loss = evaluate(self.step.engine, self.step.objective, self.val_batches, self.tracker)
        self.monitors.on_eval(EvalReport(step=self.state.step, val_loss=val_loss, time=time.time()))
        return val_loss

    # ---- checkpoints, resume, signals ----------------------------------------------------

    def _outer_step(self, force: bool) -> None:
        """Delayed synchronisation's outer step when due, or before a checkpoint, the last step or a
        stop (`force`: a checkpoint holds one model); its wait is the step's `grad_sync`."""
        if force or self.state.outer.due(self.state.step):
            self.tracker.enter(Phase.GRAD_SYNC, detail="outer step")
            self.state.outer.sync(self.state.step, force=force)

    def _save_checkpoint(self) -> None:
        self.tracker.enter(Phase.CHECKPOINT)
        self.checkpointer.save(self.state.step, self.state.state_dict(), info={"tokens": self.state.tokens})

    def resume(self, path: Path, resumed_step: int, **facts) -> None:
        """Continue from checkpoint `path` (of step `resumed_step`): saves newer than it that never
        committed are discarded, the state is loaded, and the resume is recorded."""
        self.checkpointer.discard_uncommitted(resumed_step=resumed_step)
        self.state.load(path)
        self.state.record_resume(path, self.events.emit, self._message, **facts)

    def restarted(self, event: dict, line: str) -> None:
        """The elastic agent restarted the group (commands/elastic.py): its `restart` event and line."""
        self.events.emit("restart", self.state.step, **event)
        self.logger.warning(line)
        self._message(line)

    @contextlib.contextmanager
    def _signals_stop_the_loop(self):
        """SIGTERM (pre-emption) and SIGINT finish the step, save a checkpoint and stop.

        A second SIGINT interrupts at once (the default handler is back after the first).
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum, frame):
            self.stop_signal = signum
            signal.signal(signum, previous[signum])

        previous = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_stop(self) -> None:
        name = signal.Signals(self.stop_signal).name
        self.events.emit("stopped", self.state.step, signal=name)
        self._message(f"{name} received: stopped after step {self.state.step} with a checkpoint")

    def _message(self, text: str) -> None:
        self.monitors.message(text)

    def close(self) -> None:
        """Every part, each even when one closed before it fails (the checkpointer re-raises a failed
        save): the monitors must finish their records before the process ends."""
        with contextlib.ExitStack() as stack:  # closes last registered first: phase memory ... logger
            for close in self.closing:
                stack.callback(close)
