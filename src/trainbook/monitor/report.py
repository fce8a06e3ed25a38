"""The facts one training step produces, and what monitors know of the run besides (`RunInfo`).
The trainer makes them; monitors only read them."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from trainbook.phase import PhaseTracker
from trainbook.runs import RunPaths


@dataclass(frozen=True)
class RankSpread:
    """One value per rank (index = rank) for each measured quantity."""

    step_time_s: list[float]
    data_wait_s: list[float]
    mem_peak_bytes: list[int]

    def summary(self) -> dict:
        """min, max and which rank for each quantity (the metrics.jsonl form)."""
        out = {}
        for key in ("step_time_s", "data_wait_s", "mem_peak_bytes"):
            values = getattr(self, key)
            lo = min(range(len(values)), key=values.__getitem__)
            hi = max(range(len(values)), key=values.__getitem__)
            out[key] = {"min": values[lo], "min_rank": lo, "max": values[hi], "max_rank": hi}
        return out


@dataclass(frozen=True)
class RankTimes:
    """Where each rank's time went in one logged step (index = rank), and how long it waited for
    the others at the straggler probes (train/stragglers.py; the `straggler` alert judges it)."""

    hosts: list[str]
    step_time_s: list[float]
    data_s: list[float]
    """The data phase: each rank's own work, no collectives in it."""
    compute_s: list[float]
    """forward + backward + optimizer (with the communication FSDP and DDP overlap with backward)."""
    comm_s: list[float]
    """grad_sync less the probes: the exposed communication."""
    wait_data_s: list[float]
    """Seconds in the probes after the data of each micro-batch: how much later than this rank
    the last one finished its data."""
    wait_compute_s: list[float]
    """Seconds in the probe after backward: how much later the last rank finished its backward."""

    def lateness(self) -> list[float]:
        """Per rank: how long the others wait for it at the probes (the median of the others'
        waits less its own, data and backward probes added), seconds."""
        return [sum(_others_median(waits, rank) - waits[rank] for waits in (self.wait_data_s, self.wait_compute_s))
                for rank in range(len(self.hosts))]

    def excess(self, rank: int) -> dict[str, tuple[float, float]]:
        """{"data": (its seconds, the others' median), "compute": ..., "comm": ...}."""
        return {key: (values[rank], _others_median(values, rank))
                for key, values in (("data", self.data_s), ("compute", self.compute_s), ("comm", self.comm_s))}


def _others_median(values: list[float], rank: int) -> float:
    return statistics.median(v for r, v in enumerate(values) if r != rank)


def expert_summary(load: dict[str, dict]) -> dict[str, float | None]:
    """The metrics.jsonl keys of an expert-load record: the worst layer's imbalance (max / mean
    tokens) and idle share, the lowest mean router entropy, the layers' mean balancing loss."""
    def pick(key, how):
        values = [v[key] for v in load.values() if v[key] is not None]
        return how(values) if values else None

    aux = [v["aux_loss"] for v in load.values() if v["aux_loss"] is not None]
    return {"moe_imbalance": pick("imbalance", max), "moe_idle_frac": pick("idle_frac", max),
            "moe_entropy": pick("entropy", min), "moe_aux_loss": round(math.fsum(aux) / len(aux), 6) if aux else None}


@dataclass(frozen=True)
class RunInfo:
    """What monitors may know about the run besides its reports."""

    paths: RunPaths
    """The run directory's files (monitor/build.py hands each sink its own)."""
    run_name: str
    rank: int
    world_size: int
    max_steps: int
    tracker: PhaseTracker | None = None
    """What this rank is doing now (a stall alert says where the loop is stuck)."""


@dataclass(frozen=True)
class StepReport:
    step: int
    """Optimizer steps completed (1-based)."""
    tokens: int
    """Tokens trained on so far."""
    loss: float
    """Mean training loss over this step's micro-batches."""
    lr: float
    grad_norm: float
    """Global gradient norm before clipping."""
    tokens_per_s: float
    step_time_s: float
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds spent in data, forward, backward, optimizer."""
    mem_peak_bytes: int = 0
    loss_scale: float | None = None
    """fp16: the loss scale this step ran with; None when no loss scaling is needed."""
    skipped_steps: int | None = None
    """fp16: steps skipped so far because their gradients overflowed; None without loss scaling."""
    time: float = 0.0
    samples: int = 0
    """Global samples the run has taken after this step (the data position a resume continues
    at, whatever the world size): a replayed or skipped sample shows as a jump."""
    data_mix: dict | None = None
    """Per training source: {"target": its weight's share, "actual": its share of the rows all
    ranks' steps took since the previous record, "rows": those rows}; at the logging cadence only."""
    skipped: bool = False
    """fp16: this step's gradients overflowed and its update was dropped (counted in skipped_steps)."""
    mfu: float | None = None
    """Model FLOPs utilisation (monitor/flops.py); None when the device's peak is unknown."""
    data_wait_share: float = 0.0
    """Share of the step spent waiting for data (phases["data"] / step_time_s)."""
    cpu_wait_share: float | None = None
    """Share of the step the training thread was ready to run but waited for a CPU (another
    process held it; monitor/host.py); None where the OS does not say."""
    mem_growth_by_phase: dict[str, int] | None = None
    """Bytes of this step's memory growth each phase left behind (diagnose/phase_memory.py; what a
    phase allocates and a later one frees is not counted); None where not measured."""
    ranks: RankSpread | None = None
    """Every rank's step time, data wait and peak memory; gathered at the logging cadence only
    (None on other steps and in one process)."""
    rank_times: RankTimes | None = None
    """Where each rank's time went and how long the others waited for it; at the logging cadence,
    with the `straggler` alert on and more than one process (None otherwise)."""
    objective: dict | None = None
    """What the training objective measured in the step (train/objective.py: fine-tuning's
    `trained_tokens`), written as keys of the record itself; None for next-token pre-training."""
    grad_bytes: int | None = None
    """Bytes this rank handed to DDP's gradient collectives in the step (`parallel.count_grad_bytes`;
    parallel/compression.py); the key is left out of the record where not counted."""
    experts: dict[str, dict] | None = None
    """A mixture of experts, at the logging cadence: each MoE layer's expert load since the
    previous record (train/experts.py says the keys), written whole to experts.jsonl; the
    record carries its summary (`expert_summary`)."""

    def metrics_record(self) -> dict:
        """The `metrics.jsonl` line (keys are a contract, see DESIGN.md). A skipped fp16 step's
        gradient norm is inf: written as null, since JSON has no infinity."""
        record = {"kind": "train", **asdict(self)}
        del record["skipped"]  # the running count, skipped_steps, is the recorded fact
        del record["rank_times"]  # the straggler alert's input; the alert is the recorded fact
        record.update(record.pop("objective") or {})
        if record["grad_bytes"] is None:
            del record["grad_bytes"]
        experts = record.pop("experts")
        if experts is not None:
            record.update(expert_summary(experts))
        record["ranks"] = self.ranks.summary() if self.ranks is not None else None
        if record["grad_norm"] != record["grad_norm"] or abs(record["grad_norm"]) == float("inf"):
            record["grad_norm"] = None
        return record


@dataclass(frozen=True)
class EvalReport:
    step: int
    val_loss: float
    time: float

    def metrics_record(self) -> dict:
        return {"kind": "eval", **asdict(self)}


@dataclass(frozen=True)
class LayerReport:
    """Per-layer statistics of one step (diagnose/layers.py), every `monitor.layer_stats_every` steps.

    `blocks` maps a block name ("embed", "layers.0", ..., "norm", "output") and `groups` a
    parameter group ("decay", "no_decay") to {"grad_norm", "param_norm", "update_ratio"}; blocks
    with activations also carry {"act_mean", "act_std", "act_max_abs", "act_zero_frac"}. All
    values are global (over every rank's shard and every data-parallel rank's batch).
    """

    step: int
    blocks: dict[str, dict[str, float]]
    groups: dict[str, dict[str, float]]
    time: float

    def record(self) -> dict:
        """The `layers.jsonl` line."""
        return {"step": self.step, "time": self.time, "blocks": self.blocks, "groups": self.groups}


@dataclass(frozen=True)
class Alert:
    """An alert rule fired (monitor/alerts.py). Top-level keys of the webhook payload."""

    run: str
    rank: int
    rule: str
    value: float | None
    step: int
    time: float
    message: str
    threshold: float | None = None

    def payload(self) -> dict:
        """The JSON object (webhook body, command stdin, events.jsonl line): a NaN/inf value is
        null, since JSON has neither (the message says which it was)."""
        record = asdict(self)
        if record["value"] is not None and not math.isfinite(record["value"]):
            record["value"] = None
        return record
