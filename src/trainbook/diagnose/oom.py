"""Out of memory: what the rank held when an allocation failed, against `trainbook plan`'s
estimate, the layouts plan says fit instead, written down and said in one line.

On an allocation failure (torch.OutOfMemoryError, or the CPU allocator's RuntimeError) in a
training step, the failing rank writes `oom/rank<R>.json`:

- `measured`: this rank's `parameters`, `gradients` and `optimizer` states (local shards),
  `fsdp_gathered` (FSDP's full copies of the blocks in flight, apart), the allocator's
  `allocated`/`reserved` (accelerators) or the resident set `rss` (CPU), and `peak`; with
  `[diagnose] memory_history` also `activations_by_block`, the bytes each block saved for
  backward in the failing micro-batch (saved-tensor hooks);
- `estimated`: without memory_history, `activations_by_block` from plan's per-block formula
  (what a whole micro-batch saves: measurement after the fact is impossible cheaply);
- `plan`: plan's estimate of this rank (parameters, gradients, optimizer, activations,
  communication buffers, total) and the device's capacity (on CPU under an address-space limit,
  RLIMIT_AS, the limit less what the process maps besides its states: `address_space`);
- `alternatives`: the changes plan says fit (activation checkpointing, a smaller micro-batch with
  more accumulation for the same global batch, more FSDP sharding, tensor parallel; some with more
  ranks), each as exact `key=value` overrides with plan's per-rank estimate, best first;
- `verdict`: the one line `trainbook run` ends with (exit 3).

The failing rank also writes the run's `oom/breakdown.json` and its `oom` event (appended to
events.jsonl, rank 0's file, by one atomic write), then ends: its peers, blocked in a collective
with it, fail at once (gloo: the connection closes; NCCL: the launcher stops them), find its file
for the step they were in, and end with the same verdict, rank 0 printing it. A launcher that
stops rank 0 before it speaks still finds the event (commands/launch.py). With CUDA and
memory_history the allocator's history goes to `oom/snapshot.pickle` (`oom/snapshot-rank<R>.pickle`
in a multi-rank run).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainbook.atomic import atomic_write_json
from trainbook.config import DiagnoseConfig
from trainbook.diagnose.memory import (
    SavedActivations, blocks_of, failing_block, held_bytes, out_of_memory_error, requested_bytes,
)
from trainbook.errors import DiagnosedFailure, TrainbookError, one_line
from trainbook.monitor import EventLog
from trainbook.parallel.device import device_memory_bytes, memory_facts
from trainbook.parallel.dims import ParallelDims, pipeline_microbatches, resolve_dims
from trainbook.parallel.heads import check_heads
from trainbook.parallel.plan import memory_estimates
from trainbook.model.moe import is_moe_layer
from trainbook.parallel.plan_memory import PlanInputs, activation_terms, residual_bytes
from trainbook.parallel.runtime import Runtime
from trainbook.phase import PhaseState
from trainbook.runs import RunPaths
from trainbook.sizes import human

try:  # POSIX only. Imported now: at an out-of-memory moment the extension could not be loaded.
    import resource
except ImportError:
    resource = None

CHECKPOINTING = ("none", "selective", "full")  # least recomputation first


@dataclass(frozen=True)
class Candidate:
    """A change to try: its overrides (and the ranks it needs), the recipe and layout it makes."""

    overrides: tuple[str, ...]
    world_size: int
    inputs: PlanInputs
    dims: ParallelDims


def candidates(inputs: PlanInputs, dims: ParallelDims) -> list[Candidate]:
    """What could make a rank hold less, in the order to prefer them (least cost to throughput
    first): selective then full activation checkpointing, halving the micro-batch (the same global
    batch, more accumulation), folding replicas into FSDP shards, trading FSDP shards for tensor
    parallel, then the same on twice the ranks. Layouts the model or batch cannot take are left out."""
    t, p = inputs.train, inputs.parallel
    tokens = t.grad_accum_steps(dims.dp) * t.micro_batch_size * t.seq_len * dims.dp  # per optimizer step
    keep_batch = () if t.global_batch_tokens else (f"train.global_batch_tokens={tokens}",)
    out = []

    def with_train(**update) -> PlanInputs:
        return dataclasses.replace(inputs, train=t.model_copy(update=update))

    ac = CHECKPOINTING.index(t.activation_checkpoint)
    smaller = []
    pipeline_cut = pipeline_microbatches(p, dims.pp) if dims.pp > 1 else 1
    m = t.micro_batch_size // 2
    while m >= pipeline_cut and m % pipeline_cut == 0 and len(smaller) < 3:
        smaller.append(Candidate((f"train.micro_batch_size={m}", *keep_batch), dims.world_size,
                                 with_train(micro_batch_size=m, global_batch_tokens=tokens), dims))
        m //= 2
    if ac < 1:
        out.append(Candidate(("train.activation_checkpoint=selective",), dims.world_size,
                             with_train(activation_checkpoint="selective"), dims))
    out += smaller[:1]
    if ac < 2:
        out.append(Candidate(("train.activation_checkpoint=full",), dims.world_size,
                             with_train(activation_checkpoint="full"), dims))
    out += smaller[1:]
    layouts = []
    if dims.dp_replicate > 1 and p.data_parallel == "fsdp":
        layouts.append(dataclasses.replace(dims, dp_replicate=1, dp_shard=dims.dp))
    if dims.dp_shard % 2 == 0:
        layouts.append(dataclasses.replace(dims, dp_shard=dims.dp_shard // 2, tp=dims.tp * 2))
    layouts.append(dataclasses.replace(dims, dp_shard=dims.dp_shard * 2))
    layouts.append(dataclasses.replace(dims, tp=dims.tp * 2))
    for layout in layouts:
        candidate = _layout_candidate(inputs, dims, layout, tokens, keep_batch)
        if candidate is not None:
            out.append(candidate)
    return out


def _layout_candidate(inputs: PlanInputs, dims: ParallelDims, layout: ParallelDims, tokens: int,
                      keep_batch: tuple[str, ...]) -> Candidate | None:
    """The recipe on `layout`, its degrees pinned where they differ from the recipe's; None when
    the model or the global batch cannot be laid out so."""
    t, p, m = inputs.train, inputs.parallel, inputs.model
    degrees = layout.sizes()
    parallel = p.model_copy(update=degrees)
    try:
        resolve_dims(parallel, layout.world_size, "")
        check_heads(m, layout.tp, "")
    except TrainbookError:
        return None
    if tokens % (t.seq_len * t.micro_batch_size * layout.dp):
        return None
    overrides = tuple(f"parallel.{k}={v}" for k, v in degrees.items() if getattr(p, k) != v)
    if layout.dp != dims.dp:
        overrides += keep_batch  # the same global batch over a different number of replicas
    train = t.model_copy(update={"global_batch_tokens": tokens})
    return Candidate(overrides, layout.world_size, dataclasses.replace(inputs, train=train, parallel=parallel), layout)


def judge(current: dict, considered: list[tuple[Candidate, dict]], rank: int, capacity: int) -> list[dict]:
    """The candidates plan says fit `capacity` on every rank and hold less than `current` (the
    plan's memory of the recipe as it ran), in the order of preference, each
    {"overrides", "world_size", "estimate_bytes"} (`estimate_bytes`: its largest rank)."""
    now = _rank_total(current, rank)
    out = []
    for candidate, memory in considered:
        need = memory["largest"]["total"]
        if need <= capacity and need < now:
            out.append({"overrides": list(candidate.overrides), "world_size": candidate.world_size,
                        "estimate_bytes": need})
    return out


def _rank_total(memory: dict, rank: int) -> int:
    row = next((r for r in memory["per_rank"] if r["rank"] == rank), None)
    return (row or memory["largest"])["total"]


def verdict(facts: dict, breakdown: Path, world_size: int) -> str:
    """The one line: where it failed, what was asked and held, plan's view, what to try (and
    `breakdown`, the file that says more)."""
    where = ", ".join(x for x in (facts["phase"], facts.get("block")) if x)
    on = f" on rank {facts['rank']}" if world_size > 1 else ""
    m, plan = facts["measured"], facts["plan"]
    states = m["parameters"] + m["gradients"] + m["optimizer"]
    held = (f"{human(m['allocated'])} allocated, {human(m['reserved'])} reserved" if "allocated" in m
            else f"{human(m['rss'])} resident")
    asked = facts.get("requested_bytes")
    capacity = plan["device_memory"]
    line = (f"out of memory in step {facts['step']} ({where}){on}: "
            + (f"could not allocate {human(asked)} " if asked else "")
            + f"with {held} on {facts['device']}, {human(states)} of it parameters, gradients and optimizer "
            f"states; plan estimates {human(plan['total'])}/rank of {human(capacity)}; "
            f"see {breakdown}")
    if asked is not None and asked > capacity:
        return line + f"; the one request is larger than the whole device ({human(capacity)}): no layout makes it fit"
    best = next(iter(facts["alternatives"]), None)
    if best is None:
        return line + "; no change plan knows of fits: shard over more devices"
    ranks = f" with --nproc {best['world_size']}" if best["world_size"] != world_size else ""
    return line + f"; try {' '.join(best['overrides'])}{ranks} (plan: {human(best['estimate_bytes'])}/rank)"


def _address_space_size() -> int | None:
    """This process's `VmSize` (address space mapped now) in bytes; None without /proc."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")), None)
    except OSError:
        return None


def _address_space_limit() -> int | None:
    """The soft RLIMIT_AS (ulimit -v, prlimit) now, or None when there is none (or no such limit here)."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def _untracked_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int | None:
    """Address space this process maps besides the training state plan counts: its whole size now
    (interpreter, libraries, data, thread stacks) less the states it holds already."""
    size = _address_space_size()
    if size is None:
        return None
    held = held_bytes(model, optimizer)
    return max(0, size - held["parameters"] - held["gradients"] - held["optimizer"])


class OutOfMemory:
    """The trainer's out-of-memory post-mortem (see the module docstring). Built once the model,
    optimizer and events exist; it writes the run's `oom/` (of `paths`). `diagnose(error)` turns a
    failure into a DiagnosedFailure (or None when it is not an allocation failure here or on a
    peer)."""

    def __init__(self, cfg: DiagnoseConfig, inputs: PlanInputs, rt: Runtime, model: nn.Module,
                 optimizer: torch.optim.Optimizer, paths: RunPaths, events, logger: logging.Logger):
        self.cfg = cfg
        self.inputs = inputs
        self.rt = rt
        self.model = model
        self.optimizer = optimizer
        self.paths = paths
        self.events = events
        self.logger = logger
        self.started = time.time()  # files older than this belong to an earlier attempt
        self.blocks = blocks_of(model)
        self.untracked = _untracked_bytes(model, optimizer) if rt.device.type == "cpu" else None
        self.saved = SavedActivations(self.blocks) if cfg.memory_history and inputs.train.compile is not True else None
        self.history = cfg.memory_history and rt.device.type == "cuda"
        if self.history:  # the allocator's every event, for the snapshot (pytorch.org/memory_viz)
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def diagnose(self, error: BaseException, state: PhaseState) -> DiagnosedFailure | None:
        oom = out_of_memory_error(error)
        if oom is not None:
            return self._own(oom, state)
        if self.rt.distributed:
            return self._peer(state)
        return None

    # ---- this rank failed -----------------------------------------------------------------

    def _own(self, error: BaseException, state: PhaseState) -> DiagnosedFailure:
        rank, device = self.rt.rank, self.rt.device
        # Measured first, before anything here allocates or frees.
        measured = {**held_bytes(self.model, self.optimizer), **memory_facts(device)}
        if self.saved is not None:
            self.saved.abandon()
            measured["activations_by_block"] = dict(self.saved.bytes)
        snapshot = self._snapshot()
        facts = {"step": state.step, "rank": rank, "phase": state.phase.value,
                 "block": failing_block(error, self.blocks), "device": str(device),
                 "error": one_line(error), "requested_bytes": requested_bytes(error), "measured": measured}
        if self.saved is None:
            facts["estimated"] = {"activations_by_block": self._estimated_activations()}
        facts |= self._plan_view(rank)
        facts["snapshot"] = snapshot
        breakdown = self.paths.oom / "breakdown.json"
        facts["verdict"] = verdict(facts, breakdown, self.rt.world_size)
        self.paths.oom.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.paths.oom / f"rank{rank}.json", facts, indent=2)
        atomic_write_json(breakdown, facts, indent=2)
        self.logger.error(facts["verdict"])
        self._hold_off_termination()
        event = {"phase": facts["phase"], "verdict": facts["verdict"], "breakdown": self.paths.name(breakdown),
                 "rank": rank, "block": facts["block"]}
        if self.rt.is_main:
            self.events.emit("oom", facts["step"], **event)
        else:  # rank 0 may be stopped by the launcher before it could say it
            events = EventLog(self.paths.events)
            events.emit("oom", facts["step"], **event)
            events.close()
        return DiagnosedFailure(facts["verdict"])

    def _snapshot(self) -> str | None:
        if not self.history:
            return None
        name = "snapshot.pickle" if self.rt.world_size == 1 else f"snapshot-rank{self.rt.rank}.pickle"
        self.paths.oom.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.paths.oom / name))
        return self.paths.name(self.paths.oom / name)

    def _estimated_activations(self) -> dict[str, int]:
        """Plan's per-block formula for one micro-batch: what each block saves by its end."""
        t, dims = self.inputs.train, self.rt.dims
        samples = t.micro_batch_size // (pipeline_microbatches(self.inputs.parallel, dims.pp) if dims.pp > 1 else 1)
        terms = activation_terms(self.inputs, samples, dims.tp, residual_bytes(self.inputs, dims))
        mode = t.activation_checkpoint
        return {block: terms[f"moe_block_{mode}" if is_moe_layer(self.inputs.model, int(block.split()[-1]))
                             else f"block_{mode}"] for block in self.blocks}

    def _plan_view(self, rank: int) -> dict:
        """Plan's estimate of this rank, and of every candidate change, against the capacity."""
        capacity = device_memory_bytes(self.rt.device, self._local_ranks())
        limited = self._address_space_limit()
        if limited is not None:
            capacity = min(capacity, limited["capacity"])
        found = candidates(self.inputs, self.rt.dims)
        estimates = memory_estimates([(self.inputs, self.rt.dims)] + [(c.inputs, c.dims) for c in found], capacity)
        current, others = estimates[0], list(zip(found, estimates[1:]))
        row = next((r for r in current["per_rank"] if r["rank"] == rank), current["per_rank"][0])
        plan = {k: row[k] for k in ("params", "grads", "optimizer", "transient", "total")}
        plan["activations"] = row["activations"][self.inputs.train.activation_checkpoint]
        plan |= {"device_memory": capacity, "fits": current["fits"],
                 "activation_checkpoint": self.inputs.train.activation_checkpoint}
        judged = capacity
        if limited is not None:
            plan["address_space"] = limited
            # Plan counts live tensors; glibc's malloc keeps large freed blocks in its heap once
            # its mmap threshold has risen past their size (fragmented, mapped still) while new
            # ones are mapped: a step's mapping reaches about twice plan's count. Half the
            # capacity, then (tests/e2e/test_oom.py: the advice judged at the whole one fails).
            judged = capacity // 2
        return {"plan": plan, "alternatives": judge(current, others, rank, judged),
                "considered": [{"overrides": list(c.overrides), "world_size": c.world_size,
                                "estimate_bytes": m["largest"]["total"]} for c, m in others]}

    def _address_space_limit(self) -> dict | None:
        """On CPU under an address-space limit (RLIMIT_AS, `ulimit -v`) the allocation that failed
        met the limit, not physical memory: the capacity is the limit less what the process maps
        besides the training state (`untracked`, measured when this was built)."""
        limit = _address_space_limit() if self.untracked is not None else None
        if limit is None:
            return None
        return {"limit": limit, "untracked": self.untracked, "capacity": max(0, limit - self.untracked)}

    def _local_ranks(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.rt.world_size))

    def _hold_off_termination(self) -> None:
        """Rank 0 of a multi-rank run, about to say the verdict: the launcher's SIGTERM, sent as
        soon as a peer ends, would cut it short."""
        if self.rt.distributed and self.rt.is_main and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    # ---- a peer failed --------------------------------------------------------------------

    def _peer(self, state: PhaseState) -> DiagnosedFailure | None:
        """This rank's collective failed because a peer ran out of memory (and left): its file
        says so. The lowest failing rank speaks for the run."""
        for path in sorted(self.paths.oom.glob("rank*.json"), key=lambda p: int(p.stem[4:])):
            if path.stat().st_mtime < self.started:
                continue
            facts = json.loads(path.read_text())
            if facts["step"] == state.step:
                self._hold_off_termination()
                self.logger.error(f"rank {facts['rank']} ran out of memory: {facts['verdict']}")
                return DiagnosedFailure(facts["verdict"])
        return None

    def close(self) -> None:
        if self.saved is not None:
            self.saved.close()
        if self.history:
            torch.cuda.memory._record_memory_history(enabled=None)
