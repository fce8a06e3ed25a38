"""The facts one training step produces. The trainer makes them; monitors only read them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    data_mix: dict | None = None
    """Per training source: {"target": weight share, "actual": share of the tokens consumed}."""
    skipped: bool = False
    """fp16: this step's gradients overflowed and its update was dropped (counted in skipped_steps)."""

    def metrics_record(self) -> dict:
        """The `metrics.jsonl` line (keys are a contract, see DESIGN.md). A skipped fp16 step's
        gradient norm is inf: written as null, since JSON has no infinity."""
        record = {"kind": "train", **asdict(self)}
        del record["skipped"]  # the running count, skipped_steps, is the recorded fact
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
