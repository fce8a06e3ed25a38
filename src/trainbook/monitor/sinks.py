"""Monitors: consume StepReports and EvalReports; never reach back into the trainer."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

from trainbook.atomic import atomic_write_text
from trainbook.monitor.report import Alert, EvalReport, LayerReport, StepReport


class Monitor(Protocol):
    def on_step(self, report: StepReport) -> None: ...
    def on_eval(self, report: EvalReport) -> None: ...
    def on_layers(self, report: LayerReport) -> None: ...
    def on_alert(self, alert: Alert) -> None: ...
    def message(self, text: str) -> None: ...
    def close(self) -> None: ...


class Sink:
    """A monitor that ignores what it does not use: subclasses override what they consume."""

    def on_step(self, report: StepReport) -> None:
        pass

    def on_eval(self, report: EvalReport) -> None:
        pass

    def on_layers(self, report: LayerReport) -> None:
        pass

    def on_alert(self, alert: Alert) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class Monitors(Sink):
    """Every monitor of a run behind one object: each report goes to all of them, in order.

    Alert rules are monitors too; what they fire comes back through `on_alert`, so every sink
    (log, events.jsonl, Prometheus' counter, webhooks) sees each alert.
    """

    def __init__(self, monitors: list[Monitor] | None = None):
        self.monitors: list[Monitor] = list(monitors or [])

    def add(self, monitor: Monitor) -> None:
        self.monitors.append(monitor)

    def on_step(self, report: StepReport) -> None:
        for m in self.monitors:
            m.on_step(report)

    def on_eval(self, report: EvalReport) -> None:
        for m in self.monitors:
            m.on_eval(report)

    def on_layers(self, report: LayerReport) -> None:
        for m in self.monitors:
            m.on_layers(report)

    def on_alert(self, alert: Alert) -> None:
        for m in self.monitors:
            m.on_alert(alert)

    def message(self, text: str) -> None:
        for m in self.monitors:
            m.message(text)

    def close(self) -> None:
        """Last added, first closed; each even when one closed before it fails (an unreachable
        tracking server must not leave the W&B run unfinished)."""
        with contextlib.ExitStack() as stack:
            for m in self.monitors:
                stack.callback(m.close)


class JsonlWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most one line.

    Thread-safe: an async checkpoint reports its commit from a background thread.
    """

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        self._file.close()


class EventLog(JsonlWriter):
    """events.jsonl: checkpoints, evaluations of note, resumes, alerts."""

    def emit(self, kind: str, step: int, **fields) -> None:
        self.write({"kind": kind, "step": step, "time": time.time(), **fields})


class AlertEvents(Sink):
    """Every fired alert is an `alert` line in events.jsonl."""

    def __init__(self, events: EventLog):
        self.events = events

    def on_alert(self, alert: Alert) -> None:
        self.events.write({"kind": "alert", **alert.payload()})


def rewind_metrics(path: Path, step: int) -> int:
    """Keep the records of steps <= `step` (a resume point); returns how many lines were dropped.

    Lines after the checkpoint a run resumes from were written by the attempt that crashed; the
    resumed run writes those steps again, so keeping them would duplicate steps. A line cut short
    by the crash is dropped too.
    """
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            keep = json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    atomic_write_text(path, "".join(kept))
    return dropped


def format_step(r: StepReport, max_steps: int) -> str:
    eta = (max_steps - r.step) * r.step_time_s
    return (
        f"step {r.step}/{max_steps} loss {r.loss:.4f} lr {r.lr:.2e} grad_norm {r.grad_norm:.3f} "
        f"tok/s {r.tokens_per_s:,.0f} eta {_duration(eta)}"
    )


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def due(step: int, every: int, max_steps: int) -> bool:
    """A step at the logging cadence: every `every` steps and the last one."""
    return step % every == 0 or step == max_steps


class MetricsFile(Sink):
    """metrics.jsonl: a train line every `every_steps` (and at the last step), every eval."""

    def __init__(self, path: Path, every_steps: int, max_steps: int):
        self._writer = JsonlWriter(path)
        self.every_steps = every_steps
        self.max_steps = max_steps

    def on_step(self, report: StepReport) -> None:
        if due(report.step, self.every_steps, self.max_steps):
            self._writer.write(report.metrics_record())

    def on_eval(self, report: EvalReport) -> None:
        self._writer.write(report.metrics_record())

    def close(self) -> None:
        self._writer.close()


class LayersFile(Sink):
    """layers.jsonl: one line of per-layer statistics per measured step."""

    def __init__(self, path: Path):
        self._writer = JsonlWriter(path)

    def on_layers(self, report: LayerReport) -> None:
        self._writer.write(report.record())

    def close(self) -> None:
        self._writer.close()


class ExpertsFile(Sink):
    """experts.jsonl: a mixture of experts' load per MoE layer, one line per logged step (none,
    and no file, for a dense model)."""

    def __init__(self, path: Path):
        self.path = path
        self._writer: JsonlWriter | None = None

    def on_step(self, report: StepReport) -> None:
        if report.experts is None:
            return
        if self._writer is None:
            self._writer = JsonlWriter(self.path)
        self._writer.write({"step": report.step, "time": report.time, "layers": report.experts})

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class LogLines(Sink):
    """The run log: the same plain line the console shows, at the logging cadence."""

    def __init__(self, logger: logging.Logger, every_steps: int, max_steps: int):
        self.logger = logger
        self.every_steps = every_steps
        self.max_steps = max_steps

    def on_step(self, report: StepReport) -> None:
        if due(report.step, self.every_steps, self.max_steps):
            self.logger.info(format_step(report, self.max_steps))

    def on_eval(self, report: EvalReport) -> None:
        self.logger.info(f"eval step {report.step}: val_loss {report.val_loss:.4f}")

    def on_alert(self, alert: Alert) -> None:
        self.logger.warning(f"alert {alert.rule} at step {alert.step}: {alert.message}")

    def message(self, text: str) -> None:
        self.logger.info(text)


class PlainConsole(LogLines):
    """When stdout is not a terminal: plain lines at the logging cadence, flushed at once."""

    def __init__(self, every_steps: int, max_steps: int):
        printer = logging.getLogger("trainbook.console")
        printer.propagate = False
        # This run's handler, on the stdout of now, removed at close: a second run in the same
        # process (a benchmark, a notebook) prints to its own stdout, once.
        self._handler = logging.StreamHandler(sys.stdout)
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        printer.addHandler(self._handler)
        printer.setLevel(logging.INFO)
        super().__init__(printer, every_steps, max_steps)

    def close(self) -> None:
        self.logger.removeHandler(self._handler)


class ProgressBar(Sink):
    """On a terminal: one live bar with step, loss, tokens/s and ETA; messages print above it."""

    def __init__(self, max_steps: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  tok/s {task.fields[tps]}"),
            TimeRemainingColumn(), transient=False,
        )
        self._task = self._progress.add_task("train", total=max_steps, loss="-", tps="-")
        self._progress.start()

    def on_step(self, report: StepReport) -> None:
        self._progress.update(
            self._task, completed=report.step, loss=f"{report.loss:.4f}", tps=f"{report.tokens_per_s:,.0f}"
        )

    def on_eval(self, report: EvalReport) -> None:
        self.message(f"eval step {report.step}: val_loss {report.val_loss:.4f}")

    def message(self, text: str) -> None:
        self._progress.console.print(text)

    def close(self) -> None:
        self._progress.stop()


def console_monitor(mode: str, every_steps: int, max_steps: int) -> Monitor:
    """`auto`: a bar on a terminal, plain lines otherwise."""
    if mode == "bar" or (mode == "auto" and sys.stdout.isatty()):
        return ProgressBar(max_steps)
    return PlainConsole(every_steps, max_steps)
