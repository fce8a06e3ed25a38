"""TensorBoard event files in `<run>/tb/` (`monitor.tensorboard`).

Scalars at the logging cadence (the steps metrics.jsonl has), every evaluation, and at each
per-layer statistics step one histogram per statistic across the blocks (how the gradient norm,
update ratio, activation scale spread over depth) plus a scalar per block and statistic.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainbook.monitor.report import Alert, LayerReport
from trainbook.monitor.scalars import ScalarSink, layer_series


class TensorBoardSink(ScalarSink):
    def __init__(self, log_dir: Path, every_steps: int, max_steps: int):
        from torch.utils.tensorboard import SummaryWriter

        super().__init__(every_steps, max_steps)
        # A resumed run appends a new event file to the same directory; TensorBoard merges them.
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def on_layers(self, report: LayerReport) -> None:
        for stat, values in layer_series(report).items():
            self._writer.add_histogram(f"layers/{stat}", np.asarray(values), report.step, walltime=report.time)
        super().on_layers(report)

    def on_alert(self, alert: Alert) -> None:
        self._writer.add_text(f"alerts/{alert.rule}", alert.message, alert.step, walltime=alert.time)

    def close(self) -> None:
        self._writer.close()

    def log(self, values: dict[str, float], step: int, walltime: float) -> None:
        for tag, value in values.items():
            # A float64 tensor, not the legacy float32 `simple_value`: read back, a value equals
            # the one in metrics.jsonl.
            self._writer.add_scalar(tag, value, step, walltime=walltime or None, new_style=True,
                                    double_precision=True)
