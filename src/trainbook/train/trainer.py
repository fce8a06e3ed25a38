"""The Trainer: a short list of build_* steps, then one loop that reads top-down.

Data flows one way: each step produces a StepReport, the monitors consume it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import logging
import os
import random
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import torch

import trainbook
from trainbook.checkpoint import Checkpointer, any_rank, load_state, step_of, tensor_entries
from trainbook.config import Config, dump_toml, redact_tree
from trainbook.data import Prepared, TrainLoader, val_batches
from trainbook.data.loader import DeliveredMix
from trainbook.diagnose.layers import LayerStats
from trainbook.diagnose.hang import start_hang_watchdog
from trainbook.diagnose.oom import OutOfMemory
from trainbook.diagnose.phase_memory import PhaseMemory
from trainbook.diagnose.profile import StepProfiler, device_sync, phase_boundary
from trainbook.diagnose.timeouts import explain_timeout
from trainbook.diagnose.triage import StepBatches, Triage, skipped_windows
from trainbook.errors import DiagnosedFailure, NonFiniteFailure, one_line
from trainbook.faults import fault_point
from trainbook.model import build_model, num_params
from trainbook.model.surgery import freeze, reinit, resize_vocab, trainable_summary
from trainbook.monitor import (
    EvalReport, EventLog, Monitors, RankSpread, RunInfo, StepReport, build_monitors, close_run_logger,
    setup_run_logger,
)
from trainbook.monitor.flops import device_peak, mfu, model_flops_per_token
from trainbook.monitor.health import HealthFile, attempt
from trainbook.monitor.host import cpu_times, cpu_wait_share
from trainbook.monitor.sinks import due
from trainbook.parallel.apply import ApplyOptions, parallelize
from trainbook.parallel.compile import CompileChoice, settle_compile
from trainbook.parallel.device import peak_memory_bytes
from trainbook.parallel.dims import ParallelDims
from trainbook.parallel.plan import PlanInputs
from trainbook.parallel.runtime import Runtime
from trainbook.phase import Phase, PhaseTracker
from trainbook.precision import Precision
from trainbook.train.engine import LocalEngine, PipelineEngine, lm_loss
from trainbook.train.fault_hooks import FaultyBatches, attach_block_nan, attach_memory_faults, attach_slow_sync
from trainbook.train.optim import build_optimizer, load_optimizer_state, optimizer_state, optimizer_state_like
from trainbook.train.rng import rng_state, set_rng_state
from trainbook.train.schedule import LRSchedule
from trainbook.train.step import StepResult, evaluate, reported, train_step
from trainbook.train.warmup import compile_first
from trainbook.train.stragglers import StragglerProbes


class Decision(enum.Enum):
    """What the loop does after a step (`Trainer.decide`)."""

    CONTINUE = "continue"
    SKIP = "skip"  # the step's update was dropped (fp16 overflow); training goes on
    STOP = "stop"  # save a checkpoint and stop (a signal reached some rank)
    FAIL = "fail"  # a bad step under triage policy `stop`: its record goes out, then the verdict (exit 5)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, data: Prepared, rt: Runtime | torch.device):
        """`cfg` is a resolved config (commands/resolve.py); `rt` says where this process sits (a
        bare device: one process)."""
        self.cfg = cfg
        self.rt = rt if isinstance(rt, Runtime) else Runtime(0, 1, ParallelDims(1, 1, 1, 1), rt)
        self.device = self.rt.device
        self.rank = self.rt.rank
        self.run_dir = Path(run_dir)
        self.tracker = PhaseTracker()  # what this rank is doing now; other threads read it
        dims = self.rt.dims
        # Under FSDP its mixed-precision policy casts; elsewhere autocast (parallel/apply.py).
        self.precision = Precision(cfg.precision, self.device,
                                   fsdp=dims.dp > 1 and cfg.parallel.data_parallel == "fsdp")
        seed_everything(cfg.run.seed)
        self.flops_per_token = model_flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak, self.peak_note = device_peak(self.device, cfg.precision.dtype,  # measured once a host
                                                cache=self.run_dir / "workers" / f"peak-{socket.gethostname()}.json")
        self.compiling = self._decide_compile()
        resolved = cfg  # what checkpoints describe (a resume compares it with its own resolution)
        self.cfg = cfg = self.compiling.settled(cfg)  # train.compile and train.loss: what this run does
        self.engine = self._build_engine()
        self.model = self.engine.model
        attach_block_nan(self.model, self.tracker, self._data_step)  # only when TRAINBOOK_FAULT arms it
        attach_memory_faults(self.model, self.tracker)  # likewise
        attach_slow_sync(self.engine, self.tracker)  # likewise
        self.phase_memory = PhaseMemory(self.tracker, self.device)  # where memory grows (leaks)
        self.optimizer = build_optimizer(self.model, cfg.optim, embeddings=self.engine.embeddings)
        self.schedule = LRSchedule(cfg.schedule, cfg.optim.lr, cfg.train.max_steps)
        self.scaler = self.precision.loss_scaler()
        self.train_loader = self._build_train_loader(data)
        self.batches = self._batches()
        self.val_batches = self._build_val_batches(data)
        self.logger, self.events, self.monitors = self._build_monitors()
        # Who the others wait for, timed on logged steps (the `straggler` alert); a collective.
        self.stragglers = StragglerProbes(self.rt, self.tracker) \
            if self.rt.distributed and "straggler" in cfg.alerts.rules else None
        self.layer_stats = self._build_layer_stats()
        self.profiler = self._build_phase_profile()
        self.oom = OutOfMemory(cfg.diagnose, PlanInputs(cfg.model, cfg.train, cfg.parallel, cfg.precision.dtype),
                               self.rt, self.model, self.optimizer, self.run_dir, self.events, self.logger)
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints", cfg.checkpoint, rank=self.rank, world_size=self.rt.world_size,
            describe=checkpoint_description(resolved, dims), on_commit=self._on_checkpoint_committed,
        )
        self.step = 0
        self._step_start = 0.0  # perf_counter() when the current step began (advance -> publish)
        self._layer_stats_due: LayerStats | None = None  # armed for this step; finished in publish
        self.tokens = 0
        self.stop_signal: int | None = None  # set by SIGTERM/SIGINT; the loop saves and stops
        self.failure: DiagnosedFailure | None = None  # set by triage (policy stop); the loop ends with it
        self.accum_steps = cfg.train.grad_accum_steps(dims.dp)
        self.tokens_per_step = self.accum_steps * cfg.train.micro_batch_size * cfg.train.seq_len * dims.dp
        self.triage = Triage(cfg.triage, self.rt, self.run_dir, data, self.train_loader,
                             samples_per_step=self.tokens_per_step // cfg.train.seq_len)
        # Last: from here on every rank publishes what it does; a hang stops the run with a verdict.
        self.watchdog = start_hang_watchdog(cfg.parallel.hang_watch_s, self.rt, self.tracker, self.run_dir,
                                            self.logger)

    def _build_engine(self) -> LocalEngine | PipelineEngine:
        """The full model on every rank (same seed, same init, or imported weights), fine-tuning
        surgery, then this rank's part of it and the engine that runs it."""
        cfg, rt = self.cfg, self.rt
        model = self._import_model() if cfg.model.init_from else build_model(cfg.model, self.device, seed=cfg.run.seed)
        unmatched = reinit(model, cfg.train.reinit, cfg.model.init_std, cfg.run.seed + 1)
        unmatched += freeze(model, cfg.train.freeze)
        # Reported once the run log exists (_announce).
        self.notes = [f"pattern {p!r} in train.freeze/train.reinit matches no parameter" for p in unmatched]
        self.trainable = trainable_summary(model)
        opts = ApplyOptions(cfg.train.activation_checkpoint, cfg.train.compile, cfg.parallel.data_parallel,
                            self.precision.fsdp_policy(), loss=cfg.train.loss)
        if rt.dims.pp > 1:
            from trainbook.parallel.pipeline import build_pipeline

            pipeline = build_pipeline(
                model, rt.dims, rt.mesh["pp"], rt.pp_rank, cfg.parallel, self.device, lm_loss,
                parallelize_stage=lambda stage: parallelize(stage, rt.dims, rt.mesh, opts),
            )
            return PipelineEngine(pipeline, self.precision, rt, self.tracker)
        return LocalEngine(parallelize(model, rt.dims, rt.mesh, opts), self.precision, rt, self.tracker)

    def _decide_compile(self) -> CompileChoice:
        """`train.compile` / `train.loss` settled for this run (parallel/compile.py): as an earlier
        attempt of it settled them, else on the slowest rank's peak so every rank agrees."""
        cfg, dims = self.cfg, self.rt.dims
        peaks = [row[0] for row in self.rt.all_gather_floats([self.peak.flops if self.peak else -1.0])]
        tokens = cfg.train.grad_accum_steps(dims.dp) * cfg.train.micro_batch_size * cfg.train.seq_len * dims.dp
        return settle_compile(self.run_dir / "workers" / "compile.json", cfg.train, self.device, dims,
                              step_flops=self.flops_per_token * tokens / self.rt.world_size,
                              peak_flops=None if min(peaks) <= 0 else min(peaks))

    def _import_model(self):
        """A Hugging Face Llama's weights, grown to the recipe's vocabulary if that is larger."""
        from trainbook.model.hf_import import hf_path, load_hf_weights, model_config_from_hf

        m, path = self.cfg.model, hf_path(self.cfg.model.init_from)
        imported_vocab = model_config_from_hf(path).vocab_size
        model = build_model(m.model_copy(update={"vocab_size": imported_vocab}), self.device, seed=self.cfg.run.seed)
        load_hf_weights(model, path)
        resize_vocab(model, m.vocab_size, m.resize_init, seed=self.cfg.run.seed + 2)
        return model

    def _build_train_loader(self, data: Prepared) -> TrainLoader:
        d, t = self.cfg.data, self.cfg.train
        # Unset pin_memory: pin when batches go to an accelerator (faster async copies).
        pin = d.pin_memory if d.pin_memory is not None else self.device.type != "cpu"
        # Each data-parallel rank reads its own slice; tp and pp ranks of one replica read the same.
        return TrainLoader(
            data.train, {s.name: s.weight for s in d.sources}, t.seq_len, t.micro_batch_size,
            seed=self.cfg.run.seed, rank=self.rt.dp_rank, world_size=self.rt.dims.dp, packing=d.packing,
            eos_id=data.tokenizer.eos_id, num_workers=d.num_workers, pin_memory=pin,
            on_reepoch=self._on_reepoch,
        )

    def _batches(self) -> StepBatches:
        """The loader's batches as the step takes them: through the data path's fault points when
        TRAINBOOK_FAULT arms one, counted per source (the mixture really trained on), and kept
        for the step's re-run should it be bad (triage)."""
        batches = iter(self.train_loader)
        if FaultyBatches.wanted():
            batches = FaultyBatches(batches, self.tracker, self.cfg.model.vocab_size, self.device)
        self.delivered = DeliveredMix(batches, len(self.train_loader.names))
        return StepBatches(self.delivered, self.train_loader)

    def _data_step(self) -> int:
        """Which batch of the data order the current step trains on (1-based: step N's in a run
        that never skipped data); 0 before its first micro-batch is read."""
        if not self.batches.taken:
            return 0
        return self.batches.taken[0][0] // (self.tokens_per_step // self.cfg.train.seq_len) + 1

    def _on_reepoch(self, source: str, epoch: int) -> None:
        # Called from inside a step's data phase, after the monitors exist.
        self.events.emit("reepoch", self.step, source=source, epoch=epoch)

    def _build_val_batches(self, data: Prepared) -> list:
        t = self.cfg.train
        if t.eval_every == 0:
            return []
        return list(val_batches(data.val, t.seq_len, t.micro_batch_size, t.eval_steps,
                                self.cfg.data.packing, eos_id=data.tokenizer.eos_id))

    def _build_monitors(self) -> tuple[logging.Logger, EventLog | NoEvents, Monitors]:
        """Rank 0 writes the run's records and the console; every rank keeps its own log file."""
        cfg = self.cfg
        logger = setup_run_logger(self.run_dir / "logs", rank=self.rank, level=cfg.log.level,
                                  retention_days=cfg.log.retention_days)
        events = EventLog(self.run_dir / "events.jsonl") if self.rt.is_main else None
        info = RunInfo(self.run_dir, cfg.run.name or "run", self.rank, self.rt.world_size,
                       cfg.train.last_step, self.tracker)
        monitors = build_monitors(info, cfg.log, cfg.monitor, cfg.alerts, logger, events)
        return logger, events or NoEvents(), monitors

    def _build_layer_stats(self) -> LayerStats | None:
        every = self.cfg.monitor.layer_stats_every
        if every == 0:
            return None
        # A pipeline's last stage holds a copy of a tied embedding that the first stage reports.
        copies = self.engine.embeddings if self.engine.optim_aliases else ()
        return LayerStats(self.model, self.optimizer, self.rt, every, copies=copies,
                          training_forward=self.engine.in_training_forward)

    def _build_phase_profile(self) -> StepProfiler | None:
        """The tracker's boundary hook: with `train.profile_phases` the device is synchronised at
        each phase change; `train.profile_steps`: a torch.profiler trace of those steps
        (diagnose/profile.py); rank 0 keeps health.json (where the run is) up to date."""
        t = self.cfg.train
        profiler = StepProfiler(self.run_dir, self.rank, tuple(t.profile_steps), self.device) \
            if t.profile_steps else None
        sync = device_sync(self.device) if t.profile_phases else None
        self.health = health = HealthFile(self.run_dir / "health.json") if self.rt.is_main else None
        if health is not None:
            health.set_state("starting")
        self.tracker.boundary = phase_boundary(
            (lambda *_: sync()) if sync is not None else None,  # first: the phase's work is done
            profiler.on_phase if profiler is not None else None,
            health.on_phase if health is not None else None,
        )
        return profiler

    def _before_update(self) -> None:
        self.checkpointer.wait_staged()
        if self.layer_stats is not None:
            self.layer_stats.before_update()

    # ---- the loop ------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train to `train.max_steps` (or until SIGTERM/SIGINT); returns a summary of the run."""
        t = self.cfg.train
        self._announce()
        report, decision = None, Decision.CONTINUE
        try:
            self._compile_first()
            last_eval = self._evaluate() if self.val_batches and self.step == 0 else None
            with self._signals_stop_the_loop():
                while self.step < t.last_step:
                    report = self.advance()
                    if report is None:  # rolled back (triage): on from the checkpoint
                        continue
                    if self.val_batches and (self.step % t.eval_every == 0 or self.step == t.last_step):
                        last_eval = self._evaluate()
                    decision = self.decide(report)
                    if decision is Decision.STOP or (decision is not Decision.FAIL
                                                     and self.checkpointer.due(self.step, t.last_step)):
                        self._save_checkpoint()
                    report = self.publish(report)  # its record covers the eval and checkpoint above
                    if decision is Decision.FAIL:
                        raise self.failure
                    if decision is Decision.STOP:
                        self._on_stop()
                        break
                    fault_point("train.after_step", self.step)
                self.tracker.enter(Phase.CHECKPOINT)
                self.checkpointer.wait()  # an async save still in flight is part of the run
                self.tracker.enter(Phase.IDLE)
        except BaseException as e:
            # Out of memory here or on a peer: the breakdown, the event and the one-line verdict.
            diagnosed = self.oom.diagnose(e, self.tracker.current()) if isinstance(e, Exception) else None
            failure = diagnosed or e
            # The end marker `trainbook runs` reads; a SIGKILL leaves none (see monitor/archive.py).
            self.events.emit("end", self.step, status="failed", error=f"{type(failure).__name__}: {one_line(failure)}")
            if self.health is not None:
                self.health.set_state("failed")
            if diagnosed is not None:
                raise diagnosed from e
            raise
        self.events.emit("end", self.step, status="stopped" if decision is Decision.STOP else "finished")
        if self.health is not None:
            self.health.set_state("stopped" if decision is Decision.STOP else "finished")
        return {"step": self.step, "tokens": self.tokens, "loss": report.loss if report else None,
                "val_loss": last_eval, "run_dir": str(self.run_dir),
                "stopped_by": signal.Signals(self.stop_signal).name if self.stop_signal else None}

    def advance(self) -> StepReport | None:
        """One optimizer step: set the LR, run train_step, count. Its report goes to the monitors
        once what follows the step (evaluation, checkpoint) is timed too (`publish`). None: the
        step was bad and the run rolled back to a checkpoint (triage)."""
        lr = self.schedule(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        stats = self.layer_stats if self.layer_stats is not None and self.layer_stats.due(self.step + 1) else None
        if stats is not None:
            stats.arm()
        if self.profiler is not None:
            self.profiler.before_step(self.step + 1)
        start, host_before = time.perf_counter(), cpu_times()
        self._step_start = start
        self.tracker.begin_step(self.step + 1)
        self.batches.begin()
        judge = (lambda loss, norm: self.triage.judge(loss, norm, lr)) if self.triage.enabled else None
        probe = self.stragglers if self._probed(self.step + 1) else None
        try:
            result = train_step(self.engine, self.optimizer, self.batches, self.accum_steps, self.cfg.optim.grad_clip,
                                self.scaler, self.tracker, before_update=self._before_update,
                                observe_grads=stats.observe_grads if stats is not None else None, judge=judge,
                                probe=probe)
            if result.rejected is not None:
                result = self._triage(result, judge)
                if result is None:
                    return None
            elif not result.skipped:
                self.triage.accept(result.loss, lr)
        except RuntimeError as e:
            raise self._explain(e) from e
        elapsed = time.perf_counter() - start
        waited = cpu_wait_share(host_before, cpu_times(), elapsed)
        self.step += 1
        self.tokens += self.tokens_per_step  # a skipped step consumed its data too
        # Provisional: `publish` times the whole record and settles these.
        tokens_per_s, mem = self.tokens_per_step / elapsed, peak_memory_bytes(self.device)
        report = StepReport(
            step=self.step, tokens=self.tokens, loss=result.loss, lr=lr, grad_norm=result.grad_norm,
            tokens_per_s=tokens_per_s, step_time_s=elapsed, phases=result.phases,
            mem_peak_bytes=mem, time=time.time(), samples=self.train_loader.consumed,
            mem_growth_by_phase=self.phase_memory.take(),
            loss_scale=result.loss_scale,
            skipped_steps=self.scaler.skipped if self.scaler.enabled else None, skipped=result.skipped,
            mfu=mfu(tokens_per_s, self.flops_per_token, self.peak, self.rt.world_size),
            data_wait_share=result.phases["data"] / elapsed,
            cpu_wait_share=waited,
            **self._gather(elapsed, result.phases, mem),
        )
        self._layer_stats_due = stats
        return report

    def publish(self, report: StepReport) -> StepReport:
        """The step's record, to the monitors. It covers the step from its first batch to now:
        the evaluation and checkpoint after it are its `eval` and `checkpoint` phases, so the
        phases add up to `step_time_s`; `tokens_per_s` stays the step's training throughput
        (tokens over the step's time less those two), unchanged by their cadence."""
        phases = reported(self.tracker.take_durations(), into=report.phases)
        elapsed = time.perf_counter() - self._step_start
        self.tracker.enter(Phase.IDLE)  # until the next step begins: nobody's time
        tokens_per_s = self.tokens_per_step / max(elapsed - phases["checkpoint"] - phases["eval"], 1e-9)
        report = dataclasses.replace(
            report, step_time_s=elapsed, phases=phases, data_wait_share=phases["data"] / elapsed,
            tokens_per_s=tokens_per_s, mfu=mfu(tokens_per_s, self.flops_per_token, self.peak, self.rt.world_size))
        self.monitors.on_step(report)  # read-only consumers of the report
        stats, self._layer_stats_due = self._layer_stats_due, None
        if stats is not None:  # measured after the step's timing: not part of tokens/s
            layers = stats.finish(self.step)
            if layers is not None:
                self.monitors.on_layers(layers)
        if self.profiler is not None:
            self.profiler.after_step(self.step)
        return report

    def _triage(self, first: StepResult, judge) -> StepResult | None:
        """A bad step, on every rank together (diagnose/triage.py: the re-run, the incident, the
        policy's verdict). Returns the step's result, or None after a rollback; under `stop` the
        step's record still goes out before the run ends (Decision.FAIL)."""
        step = self.step + 1
        lr = self.optimizer.param_groups[0]["lr"]
        out = self.triage.handle(
            step, first, lr, self.batches, self.model, self.engine.in_training_forward,
            rerun=lambda batches, observe: train_step(
                self.engine, self.optimizer, batches, self.accum_steps, self.cfg.optim.grad_clip, self.scaler,
                self.tracker, before_update=self._before_update, observe_grads=observe, judge=judge),
            wait_for_saves=self.checkpointer.wait,  # an async save of an earlier step is a checkpoint too
        )
        self.events.emit("incident", step, **out.event)
        if out.action == "stop":
            self.failure = NonFiniteFailure(out.line)
        else:
            self.logger.warning(out.line)
            self._message(f"triage: {out.line}")
        if out.action == "rollback":
            self._roll_back(out.rollback_to, step)
            return None
        if out.action == "skip":
            self.events.emit("skipped_step", step, reason=first.rejected.what, by="triage")
        if out.action == "continue":  # transient: the re-run's update was applied
            self.triage.accept(out.rerun.loss, lr)
        kept = out.rerun if out.action == "continue" else first
        return dataclasses.replace(kept, phases={k: v + out.rerun.phases[k] for k, v in first.phases.items()})

    def _roll_back(self, target: Path, bad_step: int) -> None:
        """Continue from checkpoint `target` and never read the next `rollback_skip_batches`
        batches of data after it; newer checkpoints belong to the abandoned trajectory."""
        removed = self.checkpointer.roll_back_to(step_of(target))
        self.load_checkpoint(target)
        start = self.train_loader.consumed
        end = start + self.cfg.triage.rollback_skip_batches * (self.tokens_per_step // self.cfg.train.seq_len)
        self.train_loader.skip(start, end)
        self.triage.rollbacks += 1
        self.events.emit("rollback", bad_step, to_step=self.step, path=str(target.relative_to(self.run_dir)),
                         skipped_samples=[start, end], skipped_batches=self.cfg.triage.rollback_skip_batches,
                         removed_checkpoints=removed)

    def _logged(self, step: int) -> bool:
        return due(step, self.cfg.log.every_steps, self.cfg.train.last_step)

    def _probed(self, step: int) -> bool:
        """The straggler probes run on every `alerts.straggler_every`-th logged step (all ranks agree)."""
        return (self.stragglers is not None and self._logged(step)
                and (step // self.cfg.log.every_steps) % self.cfg.alerts.straggler_every == 0)

    def _gather(self, step_time: float, phases: dict[str, float], mem: int) -> dict:
        """At the logging cadence: every rank's step time, data wait and peak memory (`ranks`,
        when distributed), where its time went and how long it waited at the straggler probes
        (`rank_times`, with those on), and the rows of each source all ranks took since the last
        time (`data_mix`). One collective, on the steps every rank agrees are due."""
        if not self._logged(self.step):
            return {}
        rows = self.delivered.take().tolist()
        if not self.rt.distributed:
            return {"data_mix": self.train_loader.mixture_share(np.array(rows))}
        probed = self.stragglers.figures(phases) if self._probed(self.step) else []
        table = self.rt.all_gather_floats([step_time, phases["data"], float(mem), *probed, *rows])
        # Every rank of a data-parallel replica (its tp, cp and pp ranks) took the replica's rows.
        replica = self.rt.world_size // self.rt.dims.dp
        mix_at = 3 + len(probed)  # the rows per source follow the fixed figures
        out = {
            "ranks": RankSpread([r[0] for r in table], [r[1] for r in table], [int(r[2]) for r in table]),
            "data_mix": self.train_loader.mixture_share(
                np.array(table)[:, mix_at:].sum(axis=0).astype(np.int64) // replica),
        }
        if probed:
            out["rank_times"] = self.stragglers.rank_times([r[0] for r in table], [r[3:mix_at] for r in table])
        return out

    def decide(self, report: StepReport) -> Decision:
        """The one place where how a step went changes the course of the run.

        Every rank reaches the same decision (`any_rank` is a collective). Today: stop when a
        signal reached any rank; a step whose gradients overflowed (fp16) was already skipped by
        the loss scaler and is recorded here. NaN and loss-spike triage judged the step inside
        it (all ranks together, before the update) and acted on skip and rollback already; its
        `stop` ends the run here, once the step's record is out.
        """
        if self.failure is not None:  # every rank's triage reached it together
            return Decision.FAIL
        if any_rank(self.stop_signal is not None):
            return Decision.STOP
        if report.skipped:
            self.events.emit("skipped_step", self.step, reason="gradient overflow (inf/NaN)",
                             loss_scale=report.loss_scale, next_loss_scale=self.scaler.scale_value,
                             skipped_total=self.scaler.skipped)
            self.logger.warning(f"step {self.step}: gradients overflowed at loss scale {report.loss_scale:g}; "
                                f"step skipped, scale -> {self.scaler.scale_value:g}")
            return Decision.SKIP
        return Decision.CONTINUE

    def _explain(self, error: RuntimeError) -> Exception:
        """A collective that timed out becomes one line naming the rank and what it waited for."""
        return explain_timeout(error, self.tracker.current(), self.rank, self.cfg.parallel.timeout_s)

    def _announce(self) -> None:
        t, tokens_per_step, dims = self.cfg.train, self.tokens_per_step, self.rt.dims
        layout = " x ".join(f"{k} {v}" for k, v in dims.sizes().items() if v > 1) or "one process"
        self._message(
            f"run {self.run_dir} | model {self.cfg.model.name}: {num_params(self.model):,} parameters "
            f"(this rank) | {t.max_steps} steps x {tokens_per_step:,} tokens ({self.accum_steps} x "
            f"{t.micro_batch_size} x {t.seq_len} x {dims.dp} dp) | {layout} | device {self.device}"
        )
        self._message(self.trainable)
        if self.peak is None:
            self.logger.warning(self.peak_note)
            self._message(f"warning: {self.peak_note}")
        else:
            self.logger.info(self.peak_note)
        self.logger.info(self.compiling.reason)
        self._message(self.compiling.reason)
        for note in self.notes:
            self.logger.warning(note)
            self._message(f"warning: {note}")
        if self.step == 0:
            self.events.emit("start", self.step, tokens_per_step=tokens_per_step, **_process())

    def _compile_first(self) -> None:
        """Compile before step 1 (train/warmup.py), so that no step's time holds the compile."""
        if not self.cfg.train.compile or not isinstance(self.engine, LocalEngine):
            return  # a pipeline compiles inside its first step (its schedule has no pass outside one)
        seconds = compile_first(self.engine, self.optimizer, self.scaler, self.cfg, evaluate=bool(self.val_batches))
        self.tracker.enter(Phase.IDLE)
        self.tracker.take_durations()
        self.events.emit("compiled", self.step, seconds=round(seconds, 3))
        self._message(f"compiled in {seconds:.1f} s (before step {self.step + 1}: in no step's time)")
        self.logger.info(f"compiled in {seconds:.1f} s")

    def _evaluate(self) -> float:
        val_loss = evaluate(self.engine, self.val_batches, self.tracker)
        report = EvalReport(step=self.step, val_loss=val_loss, time=time.time())
        self.monitors.on_eval(report)
        return val_loss

    # ---- checkpoints, resume, signals ----------------------------------------------------

    def _save_checkpoint(self) -> None:
        self.tracker.enter(Phase.CHECKPOINT)
        self.checkpointer.save(self.step, self.state_dict(), info={"tokens": self.tokens})

    def _on_checkpoint_committed(self, step: int, path: Path, seconds: float) -> None:
        # Async mode calls this from the thread that finished the save.
        self.events.emit("checkpoint", step, path=str(path.relative_to(self.run_dir)), seconds=round(seconds, 3))
        self._message(f"checkpoint saved: {path} ({seconds:.1f} s)")

    def state_dict(self) -> dict:
        """Everything a checkpoint holds: tensors only, so loading never unpickles.

        The LR schedule is a pure function of `trainer.step`, and the data order a pure function
        of the seed and `data.consumed`; RNG states are kept per rank.
        """
        return {
            "model": self.model.state_dict(),
            "optim": optimizer_state(self.model, self.optimizer, self.engine.optim_aliases),
            "trainer": {"step": torch.tensor(self.step), "tokens": torch.tensor(self.tokens)},
            "data": {k: torch.tensor(v) for k, v in self.train_loader.state_dict().items()},
            "rng": {f"rank{self.rank}": rng_state()},
            "precision": self.scaler.state_dict(),
        }

    def load_checkpoint(self, path: Path) -> None:
        """Continue from checkpoint `path`: model, optimizer moments, counters, data position, RNG."""
        entries = tensor_entries(path)
        state = self.state_dict()  # model tensors are the parameters: DCP loads into them in place
        state["optim"] = optimizer_state_like(self.model, entries, aliases=self.engine.optim_aliases)
        rng_key = f"rank{self.rank}"
        if f"rng.{rng_key}.torch_cpu" not in entries:  # a checkpoint from fewer ranks
            state.pop("rng")
            self.logger.warning(f"{path} has no RNG state for rank {self.rank}; it keeps its seeded state")
        if "precision.scale" not in entries:  # a checkpoint from before loss scaling
            state.pop("precision")
        load_state(path, state)
        if "precision" in state:
            self.scaler.load_state_dict(state["precision"])
        load_optimizer_state(self.model, self.optimizer, state["optim"], self.engine.optim_aliases)
        self.step = int(state["trainer"]["step"])
        self.tokens = int(state["trainer"]["tokens"])
        self.train_loader.load_state_dict({k: int(v) for k, v in state["data"].items()})
        if "rng" in state:
            set_rng_state(state["rng"][rng_key])
        # The data windows this run's rollbacks skipped (events.jsonl) are never read again.
        for start, end in self.rt.rank0_first(lambda: skipped_windows(self.run_dir / "events.jsonl")):
            self.train_loader.skip(start, end)

    def record_resume(self, path: Path, **facts) -> None:
        """Say in the log and events.jsonl where this run continues from, and what was skipped."""
        for bad, why in facts.get("skipped", []):
            self.logger.warning(f"skipped invalid checkpoint {bad}: {why}")
            self.events.emit("checkpoint_invalid", self.step, path=str(bad), reason=why)
        for key, (old, new) in facts.get("changed", {}).items():
            self.logger.warning(f"config changed since the checkpoint: {key} = {old!r} -> {new!r}")
        self.events.emit("resume", self.step, path=str(path), tokens=self.tokens, **_process(), **{
            k: v for k, v in facts.items() if k != "skipped"})
        self._message(f"resumed from {path} at step {self.step}")

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
        self.events.emit("stopped", self.step, signal=name)
        self._message(f"{name} received: stopped after step {self.step} with a checkpoint")

    def _message(self, text: str) -> None:
        self.monitors.message(text)

    def close(self) -> None:
        """Every part, each even when one closed before it fails (the checkpointer re-raises a failed
        save): the monitors must finish their records before the process ends."""
        with contextlib.ExitStack() as stack:  # closes last registered first: checkpointer ... logger
            stack.callback(close_run_logger, self.logger)
            if self.watchdog is not None:  # watches until every collective of this rank is over
                stack.callback(self.watchdog.close)
            stack.callback(self.events.close)
            stack.callback(self.monitors.close)
            stack.callback(self.train_loader.close)
            if self.layer_stats is not None:
                stack.callback(self.layer_stats.close)
            stack.callback(self.checkpointer.close)
            if self.profiler is not None:
                stack.callback(self.profiler.close)
            stack.callback(self.oom.close)
            stack.callback(self.phase_memory.close)


def _process() -> dict:
    """Which process writes this attempt of the run: `trainbook runs` tells a live run by it."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "attempt": attempt()}


class NoEvents:
    """events.jsonl is rank 0's; the other ranks' events go nowhere."""

    def emit(self, kind: str, step: int, **fields) -> None:
        pass

    def close(self) -> None:
        pass


def checkpoint_description(cfg: Config, dims: ParallelDims) -> dict:
    """What every manifest says about the run that wrote it (compatibility checks read it)."""
    text = dump_toml(cfg)
    return {
        "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "config": redact_tree(cfg.model_dump(mode="json")),  # secrets as fingerprints
        "parallel": dims.sizes(),
        "versions": {"trainbook": trainbook.__version__, "torch": torch.__version__},
    }
