"""One optimizer step: accumulate gradients over micro-batches, unscale, clip, update.

Reads like the inner loop of nanoGPT's train.py, plus loss scaling (fp16) and phase timing for the
StepReport.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from trainbook.data.loader import Batch
from trainbook.precision import LossScaler, Precision


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    """Global gradient norm before clipping; inf on a skipped step (the gradients overflowed)."""
    phases: dict[str, float]
    loss_scale: float | None = None
    """The loss scale this step ran with (fp16); None without loss scaling (fp32, bf16)."""
    skipped: bool = False
    """The gradients overflowed: no clipping, no optimizer step, weights untouched."""


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
    forward_backward: Callable[[Batch, int], torch.Tensor | None] | None = None,
    reduce_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
    clip_grad: Callable[[float], torch.Tensor] | None = None,
    phase: list[str] | None = None,
    scaler: LossScaler | None = None,
) -> StepResult:
    """Forward and backward over `accum_steps` micro-batches, then unscale, clip and step.

    `before_update` runs just before the optimizer changes any state: an async checkpoint still
    copying the previous step's state waits there, overlapped with this step's compute.
    `forward_backward(batch, accum_steps)` replaces the plain forward + backward (a pipeline
    schedule; it returns the batch's mean loss on the last stage, None elsewhere). `reduce_loss`
    turns this rank's mean loss into the global one for the report; `clip_grad(max_norm)`
    replaces the clipping (a pipeline's norm spans its stages). `phase[0]` names what the step is doing, so an error
    (a collective timing out) can say where it happened.

    `scaler` (fp16; None: no scaling) scales the loss before backward; if the unscaled gradients
    hold inf/NaN on any rank the step is skipped: no clipping, no optimizer step, gradients
    dropped, and the scaler backs off. Clipping sees unscaled gradients.
    """
    phase = phase if phase is not None else [""]
    scaler = scaler if scaler is not None else LossScaler(enabled=False)
    loss_scale = scaler.scale_value
    phases = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    loss_sum = torch.zeros((), device=device)
    for _ in range(accum_steps):
        t0 = time.perf_counter()
        phase[0] = "data"
        batch = to_device(next(batches), device)
        t1 = time.perf_counter()
        if forward_backward is not None:
            # TODO(fp16 + pp): the schedule runs backward of the loss itself, unscaled; the config
            # refuses fp16 with pp > 1 until the pipeline's loss_fn applies `scaler.scale`.
            phase[0] = "pipeline forward/backward"
            loss = forward_backward(batch, accum_steps)
            t2 = t3 = time.perf_counter()
            phases["forward"] += t2 - t1  # a schedule interleaves both: reported as forward
        else:
            phase[0] = "forward"
            with precision.autocast():
                loss = lm_loss(logits_of(model, batch), batch.targets)
            t2 = time.perf_counter()
            phase[0] = "backward"
            # Each micro-batch carries 1/accum of the gradient: the sum is the full batch's mean.
            (scaler.scale(loss) / accum_steps).backward()
            t3 = time.perf_counter()
            phases["forward"] += t2 - t1
            phases["backward"] += t3 - t2
        if loss is not None:
            loss_sum += loss.detach()
        phases["data"] += t1 - t0

    t0 = time.perf_counter()
    phase[0] = "gradient unscale"
    params = list(model.parameters())
    found_inf = scaler.unscale_(params)  # all ranks agree (an all-reduce when scaling, else False)
    if found_inf:
        # Overflow: the update would be garbage. Weights and optimizer state stay as they are.
        optimizer.zero_grad(set_to_none=True)
        grad_norm = torch.tensor(float("inf"))
    else:
        phase[0] = "gradient norm"
        # max_norm=inf measures the norm without clipping, so grad_norm is always reported.
        max_norm = grad_clip if grad_clip > 0 else float("inf")
        grad_norm = clip_grad(max_norm) if clip_grad else clip_grad_norm(params, max_norm)
        if before_update is not None:
            phase[0] = "waiting for the checkpoint copy"
            before_update()
        phase[0] = "optimizer"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    scaler.update(found_inf)
    phases["optimizer"] = time.perf_counter() - t0
    phase[0] = "loss report"
    loss = reduce_loss(loss_sum / accum_steps)
    return StepResult(
        loss=loss.item(), grad_norm=grad_norm.item(), phases=phases,
        loss_scale=loss_scale if scaler.enabled else None, skipped=found_inf,
    )


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to the global gradient norm, the norm over every shard and rank.

    In one process this is exactly `nn.utils.clip_grad_norm_`. Sharded gradients (FSDP, TP) are
    DTensors whose norm DTensor reduces over their mesh.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


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
