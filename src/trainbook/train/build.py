"""Build a Trainer: every part made once, in order, from the settled config, and handed in.

Each builder returns what it makes and sets nothing aside; the Trainer (train/trainer.py) only
runs them. Two orders matter: the model is built on the freshly seeded RNG before anything else
could draw from it, and the hang watchdog starts last (from then on every rank publishes what it
does, and a hang stops the run with a verdict).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

from trainbook.checkpoint import Checkpointer
from trainbook.config import Config
from trainbook.data import Prepared, TrainLoader, val_batches
from trainbook.data.loader import DeliveredMix
from trainbook.diagnose.hang import start_hang_watchdog
from trainbook.diagnose.layers import LayerStats
from trainbook.diagnose.oom import OutOfMemory
from trainbook.diagnose.phase_memory import PhaseMemory
from trainbook.diagnose.profile import StepProfiler, device_sync, phase_boundary
from trainbook.diagnose.triage import StepBatches, Triage
from trainbook.model import build_model
from trainbook.model.lora import apply_lora
from trainbook.model.surgery import freeze, reinit, resize_vocab, trainable_summary
from trainbook.monitor import EventLog, Monitors, RunInfo, build_monitors, close_run_logger, setup_run_logger
from trainbook.monitor.health import HealthFile
from trainbook.parallel.apply import ApplyOptions, parallelize
from trainbook.parallel.compression import compression_spec, settle_buckets
from trainbook.parallel.dims import ParallelDims
from trainbook.parallel.plan_memory import PlanInputs
from trainbook.parallel.runtime import Runtime
from trainbook.phase import Phase, PhaseTracker
from trainbook.precision import Precision, hold_frozen_projections
from trainbook.runs import RunPaths
from trainbook.train.bad_steps import BadSteps
from trainbook.train.engine import LocalEngine, PipelineEngine, lm_loss
from trainbook.train.experts import Experts
from trainbook.train.fault_hooks import (
    FaultyBatches, attach_block_nan, attach_memory_faults, attach_router_collapse, attach_slow_sync,
)
from trainbook.train.objective import MaskedTokenLoss, NextTokenLoss, Objective
from trainbook.train.observers import (
    CheckpointStaging, HealthObserver, LayerStatsObserver, Observers, ProfilerObserver, StepObserver,
    StragglerObserver,
)
from trainbook.train.optim import build_optimizer
from trainbook.train.reporting import StepReports, logged
from trainbook.train.rollout_incidents import RolloutIncidents
from trainbook.train.schedule import LRSchedule
from trainbook.train.settle import Settled, settle
from trainbook.train.state import TrainState, checkpoint_description
from trainbook.train.step import Step
from trainbook.train.stragglers import StragglerProbes
from trainbook.train.trainer import Trainer


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def one_process(cfg: Config, run_dir: Path, data: Prepared, device: torch.device) -> Trainer:
    """A Trainer of the resolved `cfg` alone in this process (benchmarks, probes), settled here."""
    rt, paths = Runtime(0, 1, ParallelDims(1, 1, 1, 1), device), RunPaths.of(run_dir)
    return build_trainer(settle(cfg, rt, paths.workers), paths, data, rt)


def build_trainer(settled: Settled, paths: RunPaths, data: Prepared, rt: Runtime) -> Trainer:
    """The Trainer of `settled.cfg` (train/settle.py) for this rank, writing into the run
    directory `paths`, over the prepared `data`."""
    cfg = settled.cfg
    tracker = PhaseTracker()  # what this rank is doing now; other threads read it
    # Under FSDP its mixed-precision policy casts; elsewhere autocast (parallel/apply.py).
    precision = Precision(cfg.precision, rt.device, fsdp=rt.dims.dp_cp > 1 and cfg.parallel.data_parallel == "fsdp")
    engine, notes, trainable = model_and_engine(cfg, rt, precision, tracker)
    model = engine.model

    logger = setup_run_logger(paths.logs, rank=rt.rank, level=cfg.log.level,
                              retention_days=cfg.log.retention_days)
    events, monitors = build_sinks(cfg, paths, rt, tracker, logger)

    def on_reepoch(source: str, epoch: int) -> None:  # from inside a step's data phase
        events.emit("reepoch", state.step, source=source, epoch=epoch)

    loader = build_train_loader(cfg, data, rt, on_reepoch)
    batches, delivered = step_batches(loader, tracker, cfg, rt.device)
    samples_per_step = settled.tokens_per_step // cfg.train.seq_len
    attach_faults(engine, tracker, lambda: data_step(batches, samples_per_step))
    phase_memory = PhaseMemory(tracker, rt.device)  # where memory grows (leaks)
    optimizer = build_optimizer(model, cfg.optim, embeddings=engine.embeddings)
    scaler = precision.loss_scaler()
    state = TrainState(model, optimizer, engine.optim_aliases, loader, scaler, rt, paths.events, logger)
    state.outer = getattr(model, "outer_loop", None)  # delayed synchronisation (parallel/local_sgd.py)
    incidents = RolloutIncidents(paths, rt, monitors.message)
    objective = build_objective(cfg, data, rt, settled.accum_steps, model, lambda: state.step,
                                incidents.reward_error)
    if cfg.grpo.enabled:  # the rollout of a step an RL alert names
        incidents.rollout = lambda: objective.last
        monitors.add(incidents)
    checkpointer = build_checkpointer(settled, paths, rt, events, monitors)

    is_logged = logged(cfg.log, cfg.train.last_step)
    stragglers = build_stragglers(cfg, rt, tracker, is_logged)
    observers = build_observers(cfg, rt, paths, optimizer, engine, tracker, monitors, checkpointer, stragglers)
    experts = Experts(engine.model, cfg.model, cfg.moe, rt, settled.accum_steps) if cfg.model.n_experts else None
    step = Step(engine, objective, optimizer, scaler, tracker, cfg.optim.grad_clip, settled.accum_steps, experts)
    triage = Triage(cfg.triage, rt, paths, data, loader, samples_per_step=samples_per_step)
    bad = BadSteps(triage, cfg.triage, step, batches, state, checkpointer, loader, scaler, observers,
                   paths=paths, samples_per_step=samples_per_step, emit=events.emit, logger=logger,
                   message=monitors.message)
    reports = StepReports(rt, tracker, loader, delivered, phase_memory, scaler,
                          tokens_per_step=settled.tokens_per_step, flops_per_token=settled.flops_per_token,
                          peak=settled.peak, logged=is_logged, stragglers=stragglers, experts=experts,
                          grad_bytes=getattr(model, "grad_bytes", None))
    oom = OutOfMemory(cfg.diagnose, PlanInputs(cfg.model, cfg.train, cfg.parallel, cfg.precision.dtype, cfg.lora),
                      rt, model, optimizer, paths, events, logger)
    # Last: from here on every rank publishes what it does; a hang stops the run with a verdict.
    watchdog = start_hang_watchdog(cfg.parallel.hang_watch_s, rt, tracker, paths, logger)
    closing = [lambda: close_run_logger(logger), *([watchdog.close] if watchdog else []), events.close,
               monitors.close, loader.close, checkpointer.close, observers.close, oom.close, phase_memory.close,
               *([objective.close] if hasattr(objective, "close") else [])]
    return Trainer(
        settled, paths, rt, tracker=tracker, step=step, schedule=LRSchedule(cfg.schedule, cfg.optim.lr,
                                                                              cfg.train.max_steps),
        batches=batches, val_batches=build_val_batches(cfg, data, rt.dims), state=state, observers=observers, bad=bad,
        reports=reports, checkpointer=checkpointer, oom=oom, logger=logger, events=events, monitors=monitors,
        closing=closing, notes=notes, trainable=trainable,
    )


def build_objective(cfg: Config, data: Prepared, rt: Runtime, micro_batches: int, model: nn.Module,
                    steps_done, on_incident=None) -> Objective:
    """Next-token loss for text; the masked loss (train/objective.py) for data prepared with loss
    masks (chat, prompt_completion), whose settings the resolution checked (commands/resolve.py);
    GRPO for `[grpo]` on prompts, DPO on preference pairs (`steps_done()`: the run's completed
    steps)."""
    if cfg.grpo.enabled:
        return build_grpo(cfg, data, rt, model, steps_done, on_incident)
    if cfg.dpo_enabled:
        return build_dpo(cfg, data, rt, model, steps_done)
    if data.train_masks is None:
        return NextTokenLoss(micro_batches)
    return MaskedTokenLoss(micro_batches, rt)


def build_grpo(cfg: Config, data: Prepared, rt: Runtime, model: nn.Module, steps_done, on_incident=None) -> Objective:
    """GRPO (train/grpo.py) on the prompts of the recipe's `prompts` sources (`grpo_inputs`,
    which `trainbook run` checked before the run directory was made), sampling with this rank's
    part of the run's own model."""
    from trainbook.model.sampler import LocalSampler
    from trainbook.train.grpo import GrpoObjective, StepCycle, grpo_inputs

    g, t = cfg.grpo, cfg.train
    prompts, rewards, stop_ids = grpo_inputs(cfg, data.tokenizer)
    local = g.completions // rt.dims.dp
    agree = None
    if rt.distributed:  # every rank of a sharded model runs the same forwards: stop when all are done
        def agree(done: bool) -> bool:
            return rt.all_reduce_mean(torch.tensor(float(done), device=rt.device), over=rt.world_size).item() == 1.0
    pad = data.tokenizer.pad_id if data.tokenizer.pad_id is not None else data.tokenizer.eos_id
    reference = None
    if g.kl_coef > 0:  # the starting policy, frozen and whole on every rank
        reference = full_model(cfg, rt.device).eval().requires_grad_(False)
    return GrpoObjective(
        g, rewards, StepCycle(prompts, g.prompts_per_step, cfg.run.seed, rt.dp_rank, rt.dims.dp),
        LocalSampler(model, batch_size=local, pad_id=pad, agree=agree, multiple_of=rt.dims.tp), model, rt,
        micro_batch_size=t.micro_batch_size, decode=data.tokenizer.decode, stop_ids=stop_ids, pad_id=pad,
        seed=cfg.run.seed, reference=reference, steps_done=steps_done, on_incident=on_incident)


def model_and_engine(cfg: Config, rt: Runtime, precision: Precision,
                     tracker: PhaseTracker) -> tuple[LocalEngine | PipelineEngine, list[str], str]:
    """The model, built on the freshly seeded RNG, through fine-tuning surgery, and the engine
    that runs this rank's part of it; the surgery's notes and what is trainable."""
    seed_everything(cfg.run.seed)
    model, notes = surgery(full_model(cfg, rt.device), cfg)
    return build_engine(model, cfg, rt, precision, tracker), notes, trainable_summary(model)


def attach_faults(engine: LocalEngine | PipelineEngine, tracker: PhaseTracker, data_step) -> None:
    """The fault points inside the model and its collectives (train/fault_hooks.py), each only
    when TRAINBOOK_FAULT arms it; `data_step()` says which batch of the data order is training."""
    attach_block_nan(engine.model, tracker, data_step)
    attach_memory_faults(engine.model, tracker)
    attach_slow_sync(engine, tracker)
    attach_router_collapse(engine.model, tracker)


def build_checkpointer(settled: Settled, paths: RunPaths, rt: Runtime, events, monitors: Monitors) -> Checkpointer:
    """Saves into `checkpoints/`, every manifest describing the run as resolved."""
    return Checkpointer(
        paths.checkpoints, settled.cfg.checkpoint, rank=rt.rank, world_size=rt.world_size,
        describe=checkpoint_description(settled.resolved, rt.dims),
        on_commit=lambda step, path, seconds: committed(events, monitors, paths, step, path, seconds),
    )


def build_dpo(cfg: Config, data: Prepared, rt: Runtime, model: nn.Module, steps_done) -> Objective:
    """DPO (train/dpo.py) on the pairs of the recipe's `preference` sources, which `trainbook run`
    checked before the run directory was made. The reference: the starting model, whole on every
    rank (`frozen`; `precompute` frees it once it has scored every pair), or the policy without its
    adapters (`adapter_off`)."""
    from trainbook.train.dpo import DpoObjective, dpo_inputs

    d = cfg.dpo
    pairs = dpo_inputs(cfg, data.tokenizer)
    reference = None
    if d.reference in ("frozen", "precompute"):
        reference = full_model(cfg, rt.device).eval().requires_grad_(False)
    pad = data.tokenizer.pad_id if data.tokenizer.pad_id is not None else data.tokenizer.eos_id
    return DpoObjective(d, pairs, rt, micro_batch_size=cfg.train.micro_batch_size, pad_id=pad, seed=cfg.run.seed,
                        policy=model, reference=reference, steps_done=steps_done)


def full_model(cfg: Config, device: torch.device) -> nn.Module:
    """The full model on every rank: the same seed, the same init, or imported weights (a
    Hugging Face model's or a trainbook run's, grown to the recipe's vocabulary if that is larger)."""
    m = cfg.model
    if not m.init_from:
        return build_model(m, device, seed=cfg.run.seed)
    if m.init_from.startswith("run:"):  # a trainbook run's newest valid checkpoint, LoRA merged
        from trainbook.train.checkpoint_model import locate_run, read_model

        _, ckpt, source = locate_run(Path(m.init_from.removeprefix("run:")))
        model = read_model(ckpt, source, device, merge_lora=True,
                           model_cfg=m.model_copy(update={"vocab_size": source.model.vocab_size}))
        resize_vocab(model, m.vocab_size, m.resize_init, seed=cfg.run.seed + 2)
        return model
    from trainbook.model.hf_import import hf_path, load_hf_weights, model_config_from_hf

    path = hf_path(m.init_from)
    model = build_model(m.model_copy(update={"vocab_size": model_config_from_hf(path).vocab_size}), device,
                        seed=cfg.run.seed)
    load_hf_weights(model, path)
    resize_vocab(model, m.vocab_size, m.resize_init, seed=cfg.run.seed + 2)
    return model


def surgery(model: nn.Module, cfg: Config) -> tuple[nn.Module, list[str]]:
    """Fine-tuning surgery (train.reinit, train.freeze, then `[lora]`'s adapters, which freeze
    the rest; frozen projections then held in the compute dtype); the notes on patterns that
    match nothing (reported once the run log exists)."""
    unmatched = reinit(model, cfg.train.reinit, cfg.model.init_std, cfg.run.seed + 1)
    unmatched += freeze(model, cfg.train.freeze)
    notes = [f"pattern {p!r} in train.freeze/train.reinit matches no parameter" for p in unmatched]
    notes += apply_lora(model, cfg.lora, cfg.run.seed + 3)  # adapters on the loaded base
    hold_frozen_projections(model, cfg.precision.dtype)
    return model, notes


def build_engine(model: nn.Module, cfg: Config, rt: Runtime, precision: Precision,
                 tracker: PhaseTracker) -> LocalEngine | PipelineEngine:
    """This rank's part of `model` and the engine that runs it."""
    opts = ApplyOptions(cfg.train.activation_checkpoint, cfg.train.compile, cfg.parallel.data_parallel,
                        precision.fsdp_policy(cfg.parallel.reduce_dtype), loss=cfg.train.loss,
                        cp_load_balance=cfg.parallel.cp_load_balance,
                        compression=compression_spec(cfg.parallel, cfg.train.grad_accum_steps(rt.dims.dp)),
                        local_sgd=cfg.parallel if cfg.parallel.sync_every else None)
    if rt.dims.pp > 1:
        from trainbook.parallel.pipeline import build_pipeline

        pipeline = build_pipeline(
            model, rt.dims, rt.mesh["pp"], rt.pp_rank, cfg.parallel, rt.device, lm_loss,
            parallelize_stage=lambda stage: parallelize(stage, rt.dims, rt.mesh, opts),
        )
        return PipelineEngine(pipeline, precision, rt, tracker)
    model = parallelize(model, rt.dims, rt.mesh, opts)
    if (hook := getattr(model, "grad_compression", None)) is not None:
        if opts.compression.mode == "powersgd":
            settle_buckets(model, hook, rt.device)
        hook.on_reduce = lambda: tracker.enter(Phase.GRAD_SYNC, detail="gradient reduction", boundary=False)
    engine = LocalEngine(model, precision, rt, tracker)
    engine.apart = getattr(model, "outer_loop", None) is not None
    return engine


def build_sinks(cfg: Config, paths: RunPaths, rt: Runtime, tracker: PhaseTracker,
                logger: logging.Logger) -> tuple[EventLog | NoEvents, Monitors]:
    """Rank 0 writes the run's records and the console; every rank keeps its own log file."""
    events = EventLog(paths.events) if rt.is_main else None
    info = RunInfo(paths, cfg.run.name or "run", rt.rank, rt.world_size, cfg.train.last_step, tracker)
    monitors = build_monitors(info, cfg.log, cfg.monitor, cfg.alerts, logger, events)
    return events or NoEvents(), monitors


def build_train_loader(cfg: Config, data: Prepared, rt: Runtime, on_reepoch) -> TrainLoader:
    d, t = cfg.data, cfg.train
    # Unset pin_memory: pin when batches go to an accelerator (faster async copies).
    pin = d.pin_memory if d.pin_memory is not None else rt.device.type != "cpu"
    # GRPO and DPO read their prompts and pairs whole (train/grpo.py, train/dpo.py): their loader
    # is never drawn from and keeps only the checkpoint's data state, so it asks for the smallest
    # windows (a prompt file shorter than one seq_len window is fine).
    whole = cfg.grpo.enabled or cfg.dpo_enabled
    seq_len, micro = (1, 1) if whole else (t.seq_len, t.micro_batch_size)
    # Each data-parallel rank reads its own slice; tp and pp ranks of one replica read the same.
    return TrainLoader(
        data.train, {s.name: s.weight for s in d.sources}, seq_len, micro,
        seed=cfg.run.seed, rank=rt.dp_rank, world_size=rt.dims.dp, packing=d.packing,
        eos_id=data.tokenizer.eos_id, num_workers=d.num_workers, pin_memory=pin, on_reepoch=on_reepoch,
        masks=data.train_masks, loss_on=t.loss_on, pad_multiple=pad_multiple(rt.dims),
    )


def pad_multiple(dims: ParallelDims) -> int:
    """Pad packing cuts a micro-batch to its trained width rounded up to this: 8, times tp
    (sequence parallel splits the columns) and 2 x cp (context parallel deals 2 x cp chunks); 0
    under a pipeline, whose stages' shapes are fixed."""
    return 0 if dims.pp > 1 else 8 * dims.tp * (2 * dims.cp if dims.cp > 1 else 1)


def step_batches(loader: TrainLoader, tracker: PhaseTracker, cfg: Config,
                 device: torch.device) -> tuple[StepBatches, DeliveredMix]:
    """The loader's batches as the step takes them: through the data path's fault points when
    TRAINBOOK_FAULT arms one, counted per source (the mixture really trained on), and kept
    for the step's re-run should it be bad (triage)."""
    batches = iter(loader)
    if FaultyBatches.wanted():
        batches = FaultyBatches(batches, tracker, cfg.model.vocab_size, device)
    delivered = DeliveredMix(batches, len(loader.names))
    return StepBatches(delivered, loader), delivered


def data_step(batches: StepBatches, samples_per_step: int) -> int:
    """Which batch of the data order the current step trains on (1-based: step N's in a run
    that never skipped data); 0 before its first micro-batch is read."""
    if not batches.taken:
        return 0
    return batches.taken[0][0] // samples_per_step + 1


def build_val_batches(cfg: Config, data: Prepared, dims: ParallelDims) -> list:
    t = cfg.train
    if t.eval_every == 0:
        return []
    return list(val_batches(data.val, t.seq_len, t.micro_batch_size, t.eval_steps, cfg.data.packing,
                            eos_id=data.tokenizer.eos_id, masks=data.val_mask, loss_on=t.loss_on,
                            pad_multiple=pad_multiple(dims)))


def build_stragglers(cfg: Config, rt: Runtime, tracker: PhaseTracker, is_logged) -> StragglerObserver | None:
    """Who the others wait for, timed on every `alerts.straggler_every`-th logged step (the
    `straggler` alert; a collective): with the rule on and more than one process."""
    if not rt.distributed or "straggler" not in cfg.alerts.rules:
        return None
    every, probe_every = cfg.log.every_steps, cfg.alerts.straggler_every
    return StragglerObserver(StragglerProbes(rt, tracker),
                             lambda step: is_logged(step) and (step // every) % probe_every == 0)


def build_observers(cfg: Config, rt: Runtime, paths: RunPaths, optimizer: torch.optim.Optimizer,
                    engine: LocalEngine | PipelineEngine, tracker: PhaseTracker, monitors: Monitors,
                    checkpointer: Checkpointer, stragglers: StragglerObserver | None) -> Observers:
    """The checkpoint's staging, layer statistics (`monitor.layer_stats_every`), the phase
    profile (`train.profile_phases`: the device synchronised at each phase change;
    `train.profile_steps`: a torch.profiler trace of those steps), rank 0's health.json (where
    the run is, kept by the tracker's boundary hook), and the straggler probes."""
    observers: list[StepObserver] = [CheckpointStaging(checkpointer, tracker)]
    every = cfg.monitor.layer_stats_every
    if every:
        # A pipeline's last stage holds a copy of a tied embedding that the first stage reports.
        copies = engine.embeddings if engine.optim_aliases else ()
        stats = LayerStats(engine.model, optimizer, rt, every, copies=copies,
                           training_forward=engine.in_training_forward)
        observers.append(LayerStatsObserver(stats, tracker, monitors))
    t = cfg.train
    profiler = StepProfiler(paths.profile, rt.rank, tuple(t.profile_steps), rt.device) if t.profile_steps else None
    if profiler is not None:
        observers.append(ProfilerObserver(profiler))
    sync = device_sync(rt.device) if t.profile_phases else None
    health = HealthFile(paths.health) if rt.is_main else None
    if health is not None:
        health.set_state("starting")
        observers.append(HealthObserver(health))
    tracker.boundary = phase_boundary(
        (lambda *_: sync()) if sync is not None else None,  # first: the phase's work is done
        profiler.on_phase if profiler is not None else None,
        health.on_phase if health is not None else None,
    )
    return Observers(*observers, *([stragglers] if stragglers is not None else []))


def committed(events, monitors: Monitors, paths: RunPaths, step: int, path: Path, seconds: float) -> None:
    """A checkpoint is committed (async mode: called from the thread that finished the save)."""
    events.emit("checkpoint", step, path=paths.name(path), seconds=round(seconds, 3))
    monitors.message(f"checkpoint saved: {path} ({seconds:.1f} s)")


class NoEvents:
    """events.jsonl is rank 0's; the other ranks' events go nowhere."""

    def emit(self, kind: str, step: int, **fields) -> None:
        pass

    def close(self) -> None:
        pass
