"""The StepReport of each step: its timing, the logging cadence's gather, throughput and MFU.

A step is timed twice: `measure` right after the update (the step proper: what tokens/s, the
CPU wait and the gather see), `settle` once the evaluation and checkpoint after it are done too,
so the record's phases add up to its `step_time_s` while `tokens_per_s` stays the training
throughput (tokens over the step's time less those two), unchanged by their cadence.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from trainbook.config import LogConfig
from trainbook.data import TrainLoader
from trainbook.data.loader import DeliveredMix
from trainbook.diagnose.phase_memory import PhaseMemory
from trainbook.monitor import RankSpread, StepReport
from trainbook.monitor.flops import Peak, mfu
from trainbook.monitor.host import cpu_times, cpu_wait_share
from trainbook.monitor.sinks import due
from trainbook.parallel.compression import ByteTally
from trainbook.parallel.device import peak_memory_bytes
from trainbook.parallel.runtime import Runtime
from trainbook.phase import Phase, PhaseTracker
from trainbook.precision import LossScaler
from trainbook.train.experts import Experts
from trainbook.train.observers import StragglerObserver
from trainbook.train.step import StepResult, reported


def logged(log: LogConfig, last_step: int) -> Callable[[int], bool]:
    """Whether a step is on the logging cadence (the last step always is)."""
    return lambda step: due(step, log.every_steps, last_step)


class StepReports:
    def __init__(self, rt: Runtime, tracker: PhaseTracker, loader: TrainLoader, delivered: DeliveredMix,
                 phase_memory: PhaseMemory, scaler: LossScaler, *, tokens_per_step: int, flops_per_token: float,
                 peak: Peak | None, logged: Callable[[int], bool], stragglers: StragglerObserver | None,
                 experts: Experts | None = None, grad_bytes: ByteTally | None = None):
        self.rt, self.tracker, self.loader, self.delivered = rt, tracker, loader, delivered
        self.phase_memory, self.scaler = phase_memory, scaler
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
        self.logged, self.stragglers, self.experts = logged, stragglers, experts
        self.grad_bytes = grad_bytes
        self._start, self._host = 0.0, {}

    def start(self) -> None:
        """The step begins (its first batch is next)."""
        self._start, self._host = time.perf_counter(), cpu_times()

    def measure(self, step: int, tokens: int, lr: float, result: StepResult) -> StepReport:
        """The step's report right after its update; `settle` finishes its timing."""
        elapsed = time.perf_counter() - self._start
        waited = cpu_wait_share(self._host, cpu_times(), elapsed)
        tokens_per_s, mem = self.tokens_per_step / elapsed, peak_memory_bytes(self.rt.device)
        return StepReport(
            step=step, tokens=tokens, loss=result.loss, lr=lr, grad_norm=result.grad_norm,
            tokens_per_s=tokens_per_s, step_time_s=elapsed, phases=result.phases,
            mem_peak_bytes=mem, time=time.time(), samples=self.loader.consumed,
            mem_growth_by_phase=self.phase_memory.take(),
            loss_scale=result.loss_scale,
            skipped_steps=self.scaler.skipped if self.scaler.enabled else None, skipped=result.skipped,
            mfu=self._mfu(tokens_per_s),
            data_wait_share=result.phases["data"] / elapsed,
            cpu_wait_share=waited,
            objective=result.figures or None,
            **self._gather(step, elapsed, result.phases, mem),
        )

    def settle(self, report: StepReport) -> StepReport:
        """The record covers the step from its first batch to now: the evaluation and checkpoint
        after it are its `eval` and `checkpoint` phases."""
        phases = reported(self.tracker.take_durations(), into=report.phases)
        elapsed = time.perf_counter() - self._start
        self.tracker.enter(Phase.IDLE)  # until the next step begins: nobody's time
        tokens_per_s = self.tokens_per_step / max(elapsed - phases["checkpoint"] - phases["eval"], 1e-9)
        return dataclasses.replace(
            report, step_time_s=elapsed, phases=phases, data_wait_share=phases["data"] / elapsed,
            tokens_per_s=tokens_per_s, mfu=self._mfu(tokens_per_s),
            # what the gradient collectives took since the last record: the step's, and an outer
            # step's after it (parallel.sync_every)
            grad_bytes=self.grad_bytes.take() if self.grad_bytes is not None else None)

    def _mfu(self, tokens_per_s: float) -> float | None:
        return mfu(tokens_per_s, self.flops_per_token, self.peak, self.rt.world_size)

    def _gather(self, step: int, step_time: float, phases: dict[str, float], mem: int) -> dict:
        """At the logging cadence: every rank's step time, data wait and peak memory (`ranks`,
        when distributed), where its time went and how long it waited at the straggler probes
        (`rank_times`, with those on), the rows of each source all ranks took since the last
        time (`data_mix`), and a mixture of experts' load since then (`experts`). One
        collective, on the steps every rank agrees are due."""
        if not self.logged(step):
            return {}
        rows = self.delivered.take().tolist()
        load = self.experts.take() if self.experts is not None else []
        experts = {}
        if not self.rt.distributed:
            if self.experts is not None:
                experts = {"experts": self.experts.report(load)}
            return {"data_mix": self.loader.mixture_share(np.array(rows)), **experts}
        probed = self.stragglers.figures(phases) if self.stragglers is not None else []
        table = self.rt.all_gather_floats([step_time, phases["data"], float(mem), *probed, *rows, *load])
        if self.experts is not None:  # every rank's sums added up: the last columns
            experts = {"experts": self.experts.report(np.array(table)[:, len(table[0]) - len(load):].sum(axis=0).tolist())}
        # Every rank of a data-parallel replica (its tp, cp and pp ranks) took the replica's rows.
        replica = self.rt.world_size // self.rt.dims.dp
        mix_at = 3 + len(probed)  # the rows per source follow the fixed figures
        out = {
            "ranks": RankSpread([r[0] for r in table], [r[1] for r in table], [int(r[2]) for r in table]),
            "data_mix": self.loader.mixture_share(
                np.array(table)[:, mix_at:mix_at + len(rows)].sum(axis=0).astype(np.int64) // replica),
            **experts,
        }
        if probed:
            out["rank_times"] = self.stragglers.rank_times([r[0] for r in table], [r[3:mix_at] for r in table])
        return out
