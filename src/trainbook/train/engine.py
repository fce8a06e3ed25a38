"""Step engines: how one layout runs forward and backward. The trainer holds one and never asks
which.

An engine owns what differs between layouts; `Step` (train/step.py) owns what does not
(accumulation, loss scaling, clipping, the update). The protocol:

- `model`: the parameters this rank trains (the optimizer, checkpoints and reports use it);
- `forward_backward(batch, objective, scaler, aux)`: forward and backward of one micro-batch,
  adding its share of the step's loss gradient (the objective's: train/objective.py, plus what
  `aux()` returns after the forward: a mixture of experts' balancing loss) to `.grad`;
  returns this rank's loss of the batch (detached), or None where this rank computes no loss;
- `clip_grad_norm(max_norm)`: the global gradient norm (every shard, rank and stage), clipped to;
- `eval_loss(batch, objective)`: the batch's loss, forward only (None where no loss is computed);
- `report_loss(mean)`, `report_eval(total)`: this rank's value -> the value every rank reports.

`LocalEngine`: the whole model in this process, possibly sharded (FSDP, TP) or replicated (DDP).
`PipelineEngine`: this rank's pipeline stages, driven by a `torch.distributed.pipelining`
schedule that interleaves forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainbook.data.samples import Batch
from trainbook.model.loss import full_cross_entropy
from trainbook.parallel.dims import ParallelDims
from trainbook.parallel.runtime import Runtime
from trainbook.phase import Phase, PhaseTracker
from trainbook.precision import LossScaler, Precision
from trainbook.train.objective import NextTokenLoss, Objective

if TYPE_CHECKING:  # torch.distributed.pipelining is imported by pipeline runs only (start-up time)
    from trainbook.parallel.pipeline import Pipeline


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Every tensor of the batch on `device` (a producer's batch type, with more fields, stays itself)."""
    return type(batch)(*(None if t is None else t.to(device, non_blocking=True) for t in batch))


lm_loss = full_cross_entropy
"""Mean next-token cross entropy of logits (B, T, V), in fp32 whatever the compute dtype (a
pipeline's loss function when its last stage returns logits)."""


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to the global gradient norm, the norm over every shard and rank.

    In one process this is exactly `nn.utils.clip_grad_norm_`. Sharded gradients (FSDP, TP) are
    DTensors whose norm DTensor reduces over their mesh; gradients on different meshes (expert
    parallelism's experts beside the rest) are normed mesh by mesh, then combined.
    """
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():  # one foreach multiply per mesh (DTensor ops stay within one)
        nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def _whole(batch: Batch) -> Batch:
    return batch


class LocalEngine:
    embeddings: tuple = ()
    """Embedding matrices the optimizer cannot find by module type (none here)."""
    optim_aliases: dict[str, str] = {}
    """Parameter name -> the name its optimizer state is kept under in checkpoints (none here)."""

    def __init__(self, model: nn.Module, precision: Precision, rt: Runtime, tracker: PhaseTracker):
        self.model = model
        self.precision = precision
        self.rt = rt
        self.tracker = tracker
        cp = getattr(model, "context_parallel", None)
        self.shard = cp.shard if cp is not None else _whole
        """This rank's share of a batch: under context parallelism its part of each sequence."""
        self.apart = False
        """The data-parallel replicas train apart between outer steps (parallel.sync_every)."""

    def in_training_forward(self) -> bool:
        """Whether a forward running now is a training step's (hooks that gather statistics ask)."""
        return torch.is_grad_enabled()

    @classmethod
    def one_process(cls, model: nn.Module, precision: Precision) -> LocalEngine:
        """An engine for `model` alone in this process, on `precision`'s device."""
        return cls(model, precision, Runtime(0, 1, ParallelDims(1, 1, 1, 1), precision.device), PhaseTracker())

    def forward_backward(self, batch: Batch, objective: Objective, scaler: LossScaler,
                         aux: Callable[[], torch.Tensor | None] | None = None) -> torch.Tensor:
        self.tracker.enter(Phase.FORWARD)
        with self.precision.autocast():
            micro = objective.loss(self.model, self.shard(batch))
        self.tracker.enter(Phase.BACKWARD)
        # Each micro-batch carries its share of the gradient (next-token: 1/accum, so the sum is
        # the full batch's mean).
        loss = scaler.scale(micro.value) / micro.divisor
        extra = aux() if aux is not None else None  # a balancing loss, already this micro-batch's share
        if extra is not None:
            loss = loss + scaler.scale(extra)
        loss.backward()
        return micro.value.detach()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        norm = clip_grad_norm(list(self.model.parameters()), max_norm)
        if self.apart:  # each replica clipped by its own norm; all report (and judge by) their RMS
            norm = self.rt.all_reduce_mean(norm.float() ** 2, over=self.rt.dims.dp).sqrt()
        return norm

    def eval_loss(self, batch: Batch, objective: Objective) -> torch.Tensor:
        with self.precision.autocast():
            return objective.eval_loss(self.model, self.shard(batch))

    def report_loss(self, mean: torch.Tensor) -> torch.Tensor:
        # tp ranks hold copies of one replica's loss; cp ranks each their share's (equal in size)
        dims = self.rt.dims
        return self.rt.all_reduce_mean(mean, over=dims.dp * dims.tp * dims.cp)

    def report_eval(self, total: torch.Tensor) -> torch.Tensor:
        # Every rank evaluated the same batches: the same total, or under cp its share's, or
        # between outer steps (parallel.sync_every) its own replica's: their mean.
        dims = self.rt.dims
        return self.rt.all_reduce_mean(total, over=self.rt.world_size) if dims.cp > 1 or self.apart else total


class PipelineEngine:
    def __init__(self, pipeline: Pipeline, precision: Precision, rt: Runtime, tracker: PhaseTracker):
        from trainbook.parallel.pipeline import StageGroup

        self.pipeline = pipeline
        self.model = StageGroup(pipeline.modules)
        self.precision = precision
        self.rt = rt
        self.tracker = tracker
        tied = pipeline.tied_weight()  # this rank's copy of a tied embedding, if any
        # The last stage's copy is the head's weight: an embedding the optimizer must not decay.
        self.embeddings = (tied,) if tied is not None else ()
        # ... and its optimizer state keeps the embedding's name, so checkpoints move between
        # pipeline and single-device layouts.
        self.optim_aliases = {"output.weight": "tok_embeddings.weight"} \
            if tied is not None and not pipeline.has_first else {}
        cp = getattr(pipeline.modules[0], "context_parallel", None)
        self.shard = cp.shard if cp is not None else _whole
        """This rank's share of a batch: under context parallelism its part of each sequence (each
        stage derives the share's global positions itself: model/llama.py)."""

    def in_training_forward(self) -> bool:
        # Not the schedule's shape inference (uninitialised inputs), not an evaluation.
        return self.pipeline.computing and torch.is_grad_enabled()

    def forward_backward(self, batch: Batch, objective: NextTokenLoss, scaler: LossScaler,
                         aux: Callable[[], torch.Tensor | None] | None = None) -> torch.Tensor | None:
        # `aux`: resolution refuses moe.balance = aux_loss with pp > 1 (the schedule runs backward).
        # TODO(fp16 + pp): the schedule runs backward of the loss itself, unscaled; resolution
        # refuses fp16 with pp > 1 until the pipeline's loss_fn applies `scaler.scale`.
        # The schedule computes the next-token loss itself (`lm_loss`, given when it was built).
        self.tracker.enter(Phase.FORWARD_BACKWARD)
        batch = self.shard(batch)
        with self.precision.autocast():
            return self.pipeline.step(batch.inputs, batch.targets, objective.micro_batches)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.pipeline.clip_grad_norm_(max_norm)  # the norm spans every stage

    def eval_loss(self, batch: Batch, objective: NextTokenLoss) -> torch.Tensor | None:
        batch = self.shard(batch)
        with self.precision.autocast():
            return self.pipeline.eval_loss(batch.inputs, batch.targets)

    def report_loss(self, mean: torch.Tensor) -> torch.Tensor:
        # Only last-stage ranks hold a loss (the others add zeros); tp ranks hold copies, cp ranks
        # each their share's (equal in size).
        dims = self.rt.dims
        return self.rt.all_reduce_mean(mean, over=dims.dp * dims.tp * dims.cp)

    report_eval = report_loss  # the last stage's (under cp: each share's), the same on every replica
