"""The reports as flat `name -> number` maps: one naming for TensorBoard, W&B and MLflow.

Names are `section/quantity` (`train/loss`, `phase/forward_s`, `val/loss`), so the three tools
group them the same way. A value that is absent (no loss scaling, no MFU for an unknown device)
or not finite (a skipped fp16 step's gradient norm, written as null in metrics.jsonl) is left out.
"""

from __future__ import annotations

import math

from trainbook.monitor.report import EvalReport, LayerReport, StepReport
from trainbook.monitor.sinks import Sink, due


class ScalarSink(Sink):
    """A sink that takes these maps: step scalars at the logging cadence (the steps metrics.jsonl
    has), every evaluation, every layer-statistics step, each as `log(values, step, time)`."""

    def __init__(self, every_steps: int, max_steps: int):
        self.every_steps = every_steps
        self.max_steps = max_steps

    def log(self, values: dict[str, float], step: int, time: float) -> None:
        raise NotImplementedError

    def on_step(self, report: StepReport) -> None:
        if due(report.step, self.every_steps, self.max_steps):
            self.log(step_scalars(report), report.step, report.time)

    def on_eval(self, report: EvalReport) -> None:
        self.log(eval_scalars(report), report.step, report.time)

    def on_layers(self, report: LayerReport) -> None:
        self.log(layer_scalars(report), report.step, report.time)


def step_scalars(r: StepReport) -> dict[str, float]:
    out = {
        "train/loss": r.loss,
        "train/lr": r.lr,
        "train/grad_norm": r.grad_norm,
        "train/tokens": r.tokens,
        "train/tokens_per_s": r.tokens_per_s,
        "train/step_time_s": r.step_time_s,
        "train/mfu": r.mfu,
        "train/data_wait_share": r.data_wait_share,
        "train/cpu_wait_share": r.cpu_wait_share,
        "train/mem_peak_bytes": r.mem_peak_bytes,
        "train/loss_scale": r.loss_scale,
        "train/skipped_steps": r.skipped_steps,
    }
    for phase, seconds in r.phases.items():
        out[f"phase/{phase}_s"] = seconds
    for source, mix in (r.data_mix or {}).items():
        out[f"data_mix/{source}"] = mix.get("actual")
    if r.ranks is not None:
        for key in ("step_time_s", "data_wait_s", "mem_peak_bytes"):
            for rank, value in enumerate(getattr(r.ranks, key)):
                out[f"rank/{key}/{rank}"] = value
    return _numbers(out)


def eval_scalars(r: EvalReport) -> dict[str, float]:
    return _numbers({"val/loss": r.val_loss})


def layer_scalars(r: LayerReport) -> dict[str, float]:
    """One scalar per block (or parameter group) and statistic: `layers/<block>/<stat>`,
    `groups/<group>/<stat>`."""
    out = {}
    for prefix, table in (("layers", r.blocks), ("groups", r.groups)):
        for name, stats in table.items():
            for stat, value in stats.items():
                out[f"{prefix}/{name}/{stat}"] = value
    return _numbers(out)


def layer_series(r: LayerReport) -> dict[str, list[float]]:
    """Each statistic across the blocks, in block order: what a histogram over the layers shows."""
    series: dict[str, list[float]] = {}
    for stats in r.blocks.values():
        for stat, value in stats.items():
            if value is not None and math.isfinite(value):
                series.setdefault(stat, []).append(float(value))
    return series


def _numbers(values: dict) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}
