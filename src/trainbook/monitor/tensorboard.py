"""TensorBoard event files in `<run>/tb/` (`monitor.tensorboard`).

Scalars at the logging cadence (the steps metrics.jsonl has), every evaluation, and at each
per-layer statistics step one histogram per statistic across the blocks (how the gradient norm,
update ratio, activation scale spread over depth) plus a scalar per block and statistic.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainbook.monitor.report import Alert, EvalReport, LayerReport, StepReport
from trainbook.monitor.scalars import eval_scalars, layer_scalars, layer_series, step_scalars
from trainbook.monitor.sinks import Sink, due


class TensorBoardSink(Sink):
    def __init__(self, log_dir: Path, every_steps: int, max_steps: int):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run appends a new event file to the same directory; TensorBoard merges them.
        self._writer = SummaryWriter(log_dir=str(log_dir))
        self.every_steps = every_steps
        self.max_steps = max_steps

    def on_step(self, report: StepReport) -> None:
        if due(report.step, self.every_steps, self.max_steps):
            self._scalars(step_scalars(report), report.step, report.time)

    def on_eval(self, report: EvalReport) -> None:
        self._scalars(eval_scalars(report), report.step, report.time)

    def on_layers(self, report: LayerReport) -> None:
        for stat, values in layer_series(report).items():
            self._writer.add_histogram(f"layers/{stat}", np.asarray(values), report.step, walltime=report.time)
        self._scalars(layer_scalars(report), report.step, report.time)

    def on_alert(self, alert: Alert) -> None:
        self._writer.add_text(f"alerts/{alert.rule}", alert.message, alert.step, walltime=alert.time)

    def close(self) -> None:
        self._writer.close()

    def _scalars(self, values: dict[str, float], step: int, walltime: float) -> None:
        for tag, value in values.items():
            # A float64 tensor, not the legacy float32 `simple_value`: read back, a value equals
            # the one in metrics.jsonl.
            self._writer.add_scalar(tag, value, step, walltime=walltime or None, new_style=True,
                                    double_precision=True)
