"""One optimizer step: accumulate gradients over micro-batches, unscale, clip, update.

Reads like the inner loop of nanoGPT's train.py, plus loss scaling (fp16) and the phase tracker
(what this rank is doing now, and how long each part of the step took). What differs between
layouts (one process, FSDP/TP, a pipeline) is the engine's (train/engine.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from trainbook.data.samples import Batch
from trainbook.phase import Phase, PhaseTracker
from trainbook.precision import LossScaler
from trainbook.train.engine import LocalEngine, PipelineEngine, to_device
from trainbook.train.experts import Experts
from trainbook.train.objective import NextTokenLoss, Objective
from trainbook.train.observers import NO_OBSERVER, StepObserver

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
    figures: dict = field(default_factory=dict)
    """What the objective measured in the step (`Objective.figures`); empty for next-token."""


class Step:
    """One optimizer step, with what every step uses: the engine, the objective, the optimizer,
    the loss scaler (fp16; a disabled one otherwise), the tracker that times the phases (the
    caller starts the step on it: `begin_step`), gradient clipping and micro-batches a step.

    `step(batches, observer, judge)`: forward and backward over the micro-batches, then unscale,
    clip and update. If the unscaled gradients hold inf/NaN on any rank the step is skipped: no
    clipping, no optimizer step, gradients dropped, and the scaler backs off. Clipping sees
    unscaled gradients. The `observer` (train/observers.py) meets the step at its points: `at`
    the start, after each micro-batch's data and after backward (the straggler probes),
    `observe_grads` with the final gradients before clipping (layer statistics), and
    `before_update` just before the optimizer changes any state (an async checkpoint still
    copying the previous step's state waits there). `judge(loss, grad_norm)` sees the step's
    global loss and gradient norm before the update (NaN and spike triage); a verdict it returns
    rejects the step: gradients dropped, no update.
    """

    def __init__(self, engine: Engine, objective: Objective, optimizer: torch.optim.Optimizer, scaler: LossScaler,
                 tracker: PhaseTracker, grad_clip: float, micro_batches: int, experts: Experts | None = None):
        self.engine, self.objective, self.optimizer = engine, objective, optimizer
        self.scaler, self.tracker = scaler, tracker
        self.grad_clip, self.micro_batches = grad_clip, micro_batches
        self.experts = experts
        """A mixture of experts' balancing and load (train/experts.py); None for a dense model."""

    @classmethod
    def next_token(cls, engine: Engine, optimizer: torch.optim.Optimizer, micro_batches: int, grad_clip: float,
                   scaler: LossScaler, tracker: PhaseTracker) -> Step:
        """A pre-training step (`NextTokenLoss`) of `micro_batches` micro-batches."""
        return cls(engine, NextTokenLoss(micro_batches), optimizer, scaler, tracker, grad_clip, micro_batches)

    def __call__(self, batches: Iterator[Batch], observer: StepObserver = NO_OBSERVER,
                 judge: Callable[[float, float], object] | None = None) -> StepResult:
        engine, scaler, tracker = self.engine, self.scaler, self.tracker
        loss_scale = scaler.scale_value
        loss_sum = torch.zeros((), device=engine.rt.device)
        experts = self.experts
        aux = experts.aux_term if experts is not None else None
        if experts is not None:
            experts.begin()
        observer.at("start")
        for _ in range(self.micro_batches):
            tracker.enter(Phase.DATA)
            batch = to_device(next(batches), engine.rt.device)
            observer.at("data")
            loss = engine.forward_backward(batch, self.objective, scaler, aux)
            if loss is not None:
                loss_sum += loss
        observer.at("compute")

        tracker.enter(Phase.GRAD_SYNC, detail="gradient unscale")
        found_inf = scaler.unscale_(list(engine.model.parameters()))  # all ranks agree
        if found_inf:
            # Overflow: the update would be garbage. Weights and optimizer state stay as they are.
            self.optimizer.zero_grad(set_to_none=True)
            grad_norm = torch.tensor(float("inf"))
        else:
            observer.observe_grads()
            tracker.enter(Phase.GRAD_SYNC, detail="gradient norm")
            # max_norm=inf measures the norm without clipping, so grad_norm is always reported.
            grad_norm = engine.clip_grad_norm(self.grad_clip if self.grad_clip > 0 else float("inf"))
        scaler.update(found_inf)
        tracker.enter(Phase.GRAD_SYNC, detail="loss report")
        # On an accelerator `.item()` waits for backward.
        loss = engine.report_loss(self.objective.finish(loss_sum, self.micro_batches)).item()
        grad_norm = grad_norm.item()
        rejected = judge(loss, grad_norm) if judge is not None and not found_inf else None
        updated = not found_inf and rejected is None
        if updated:
            observer.before_update()
            tracker.enter(Phase.OPTIMIZER)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        elif rejected is not None:
            self.optimizer.zero_grad(set_to_none=True)  # a bad step: the weights stay as they are
        if experts is not None:  # the selection bias moves with the weights, or stays with them
            experts.end_step(updated)
        return StepResult(
            loss=loss, grad_norm=grad_norm, phases=reported(tracker.take_durations()),
            loss_scale=loss_scale if scaler.enabled else None, skipped=found_inf, rejected=rejected,
            figures=self.objective.figures(),
        )


@torch.no_grad()
def evaluate(engine: Engine, objective: Objective, batches: list[Batch], tracker: PhaseTracker) -> float:
    """Mean loss over fixed held-out batches, every layout alike."""
    tracker.enter(Phase.EVALUATION)
    model = engine.model
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=engine.rt.device)
    for batch in batches:
        loss = engine.eval_loss(to_device(batch, engine.rt.device), objective)
        if loss is not None:
            total += loss
    model.train(was_training)
    return (engine.report_eval(total) / len(batches)).item()
