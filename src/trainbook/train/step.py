"""One optimizer step: accumulate gradients over micro-batches, clip, update.

Reads like the inner loop of nanoGPT's train.py, plus phase timing for the StepReport.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainbook.data.loader import Batch
from trainbook.precision import Precision


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    phases: dict[str, float]


def to_device(batch: Batch, device: torch.device) -> Batch:
    return Batch(*(None if t is None else t.to(device, non_blocking=True) for t in batch))


def logits_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The model's logits (B, T, V); positions (document packing) go in only when present."""
    if batch.positions is None:
        return model(batch.inputs)
    return model(batch.inputs, batch.positions)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32 whatever the compute dtype."""
    # logits: (B, T, V), targets: (B, T)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[Batch],
    *,
    accum_steps: int,
    grad_clip: float,
    precision: Precision,
    device: torch.device,
    before_update: Callable[[], None] | None = None,
) -> StepResult:
    """Forward and backward over `accum_steps` micro-batches, then clip and step.

    `before_update` runs just before the optimizer changes any state: an async checkpoint still
    copying the previous step's state waits there, overlapped with this step's compute.
    """
    phases = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    loss_sum = torch.zeros((), device=device)
    for _ in range(accum_steps):
        t0 = time.perf_counter()
        batch = to_device(next(batches), device)
        t1 = time.perf_counter()
        with precision.autocast():
            loss = lm_loss(logits_of(model, batch), batch.targets)
        t2 = time.perf_counter()
        # Each micro-batch carries 1/accum of the gradient: the sum is the full batch's mean.
        (loss / accum_steps).backward()
        t3 = time.perf_counter()
        loss_sum += loss.detach()
        phases["data"] += t1 - t0
        phases["forward"] += t2 - t1
        phases["backward"] += t3 - t2

    t0 = time.perf_counter()
    # max_norm=inf measures the norm without clipping, so grad_norm is always reported.
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if before_update is not None:
        before_update()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    phases["optimizer"] = time.perf_counter() - t0
    return StepResult(loss=(loss_sum / accum_steps).item(), grad_norm=grad_norm.item(), phases=phases)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch], precision: Precision, device: torch.device) -> float:
    """Mean loss over fixed held-out batches."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for batch in batches:
        batch = to_device(batch, device)
        with precision.autocast():
            total += lm_loss(logits_of(model, batch), batch.targets)
    model.train(was_training)
    return (total / len(batches)).item()
