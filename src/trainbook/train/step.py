"""One optimizer step: accumulate gradients over micro-batches, unscale, clip, update.

Reads like the inner loop of nanoGPT's train.py, plus loss scaling (fp16) and the phase tracker
(what this rank is doing now, and how long each part of the step took). What differs between
layouts (one process, FSDP/TP, a pipeline) is the engine's (train/engine.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from trainbook.data.loader import Batch
from trainbook.phase import Phase, PhaseTracker
from trainbook.precision import LossScaler
from trainbook.train.engine import LocalEngine, PipelineEngine, to_device

Engine = LocalEngine | PipelineEngine

# How the tracker's phases add up to the step timing in metrics.jsonl (`phases`, DESIGN.md): a
# pipeline's interleaved forward and backward are reported as forward. `grad_sync` is the
# communication the step waits for after backward returns (overflow flag, gradient norm, loss
# report): the exposed part; the reduction FSDP/DDP overlap with backward is inside `backward`.
# `checkpoint` is the time a checkpoint blocks training (a synchronous save, or the wait for an
# async save's copy before the update); `eval` the evaluation after the step.
REPORTED_PHASES = {
    Phase.DATA: "data", Phase.FORWARD: "forward", Phase.FORWARD_BACKWARD: "forward",
    Phase.BACKWARD: "backward", Phase.GRAD_SYNC: "grad_sync", Phase.OPTIMIZER: "optimizer",
    Phase.CHECKPOINT: "checkpoint", Phase.EVALUATION: "eval",
}
PHASE_KEYS = ("data", "forward", "backward", "grad_sync", "optimizer", "checkpoint", "eval")


def reported(durations: dict[Phase, float], into: dict[str, float] | None = None) -> dict[str, float]:
    """The tracker's seconds per phase as `metrics.jsonl` keys (every key present), added to `into`."""
    phases = dict(into) if into is not None else dict.fromkeys(PHASE_KEYS, 0.0)
    for phase, seconds in durations.items():
        if phase in REPORTED_PHASES:
            phases[REPORTED_PHASES[phase]] += seconds
    return phases


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    """Global gradient norm before clipping; inf on a skipped step (the gradients overflowed)."""
    phases: dict[str, float]
    loss_scale: float | None = None
    """The loss scale this step ran with (fp16); None without loss scaling (fp32, bf16)."""
    skipped: bool = False
    """The gradients overflowed: no clipping, no optimizer step, weights untouched."""
    rejected: object = None
    """The judge's verdict on a bad step (diagnose/triage.py): no optimizer step, weights untouched."""


def train_step(
    engine: Engine,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[Batch],
    accum_steps: int,
    grad_clip: float,
    scaler: LossScaler,
    tracker: PhaseTracker,
    before_update: Callable[[], None] | None = None,
    observe_grads: Callable[[], None] | None = None,
    judge: Callable[[float, float], object] | None = None,
    probe: Callable[[str], None] | None = None,
) -> StepResult:
    """Forward and backward over `accum_steps` micro-batches, then unscale, clip and step. The
    caller has started the step on `tracker` (`begin_step`), which times its phases.

    `scaler` (fp16; a disabled one otherwise) scales the loss before backward; if the unscaled
    gradients hold inf/NaN on any rank the step is skipped: no clipping, no optimizer step,
    gradients dropped, and the scaler backs off. Clipping sees unscaled gradients.
    `before_update` runs just before the optimizer changes any state: an async checkpoint still
    copying the previous step's state waits there, overlapped with this step's compute.
    `observe_grads` sees the final gradients before clipping (per-layer statistics).
    `judge(loss, grad_norm)` sees the step's global loss and gradient norm before the update (NaN
    and spike triage); a verdict it returns rejects the step: gradients dropped, no update.
    `probe(where)` meets every rank at the step's start, after each micro-batch's data and after
    backward (train/stragglers.py: who the others wait for); logged steps only.
    """
    device = engine.rt.device
    loss_scale = scaler.scale_value
    loss_sum = torch.zeros((), device=device)
    if probe is not None:
        probe("start")
    for _ in range(accum_steps):
        tracker.enter(Phase.DATA)
        batch = to_device(next(batches), device)
        if probe is not None:
            probe("data")
        loss = engine.forward_backward(batch, accum_steps, scaler)
        if loss is not None:
            loss_sum += loss
    if probe is not None:
        probe("compute")

    tracker.enter(Phase.GRAD_SYNC, detail="gradient unscale")
    found_inf = scaler.unscale_(list(engine.model.parameters()))  # all ranks agree
    if found_inf:
        # Overflow: the update would be garbage. Weights and optimizer state stay as they are.
        optimizer.zero_grad(set_to_none=True)
        grad_norm = torch.tensor(float("inf"))
    else:
        if observe_grads is not None:
            tracker.enter(Phase.GRAD_SYNC, detail="layer statistics")
            observe_grads()
        tracker.enter(Phase.GRAD_SYNC, detail="gradient norm")
        # max_norm=inf measures the norm without clipping, so grad_norm is always reported.
        grad_norm = engine.clip_grad_norm(grad_clip if grad_clip > 0 else float("inf"))
    scaler.update(found_inf)
    tracker.enter(Phase.GRAD_SYNC, detail="loss report")
    loss = engine.report_loss(loss_sum / accum_steps).item()  # on an accelerator: waits for backward
    grad_norm = grad_norm.item()
    rejected = judge(loss, grad_norm) if judge is not None and not found_inf else None
    if not found_inf and rejected is None:
        if before_update is not None:
            tracker.enter(Phase.CHECKPOINT, detail="waiting for the checkpoint copy")
            before_update()
        tracker.enter(Phase.OPTIMIZER)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    elif rejected is not None:
        optimizer.zero_grad(set_to_none=True)  # a bad step: the weights stay as they are
    return StepResult(
        loss=loss, grad_norm=grad_norm, phases=reported(tracker.take_durations()),
        loss_scale=loss_scale if scaler.enabled else None, skipped=found_inf, rejected=rejected,
    )


@torch.no_grad()
def evaluate(engine: Engine, batches: list[Batch], tracker: PhaseTracker) -> float:
    """Mean loss over fixed held-out batches, every layout alike."""
    tracker.enter(Phase.EVALUATION)
    model = engine.model
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=engine.rt.device)
    for batch in batches:
        loss = engine.eval_loss(to_device(batch, engine.rt.device))
        if loss is not None:
            total += loss
    model.train(was_training)
    return (engine.report_eval(total) / len(batches)).item()
