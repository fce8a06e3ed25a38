"""The objective: what one optimizer step computes from its data. The seam post-training plugs into.

The loop (train/trainer.py) and the step (train/step.py) never ask what is being trained: they ask
the objective for the step's micro-batches, for each micro-batch's loss, and for the step's loss
as every rank reports it. `NextTokenLoss`, pre-training's mean next-token cross entropy, is the
first implementation; the others plug in at the same three places:

- supervised fine-tuning (loss masks; `MaskedTokenLoss` below): `produce` reads each step's micro-batches ahead and
  all-reduces their trained-token count (every micro-batch, every data-parallel rank); `loss`
  sums the cross entropy of the trained tokens only, with that count over the data-parallel
  size as its divisor (the ranks' gradients are averaged), so the update is the gradient of the
  global per-token mean whatever the padding; `finish` divides the sum likewise, and `figures`
  reports the count (tests/unit/train/test_objective.py: micro-batch 1 x accumulation 8 gives
  the gradients of micro-batch 8 x accumulation 1).
- preference pairs (DPO): `produce` adds the reference model's per-sequence log-probability sums
  of each pair's chosen and rejected completion (a frozen copy, forward only); `loss` computes
  the policy's sums from the logits and the pairwise loss against the reference's.
- reinforcement learning (GRPO): `produce` is the producer. Before an update it generates a batch
  of rollouts from prompts, scores them (rewards), normalises the advantages per group and keeps
  the old and reference log-probabilities; it serves the same rollouts for several updates
  before generating again. `loss` is the clipped policy loss with its KL term.

An objective other than the next-token one runs on a local engine (one process, FSDP, TP, DDP):
a pipeline's last stage computes its loss inside the schedule (parallel/pipeline.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from trainbook.data.samples import Batch
from trainbook.model.loss import IGNORE
from trainbook.parallel.runtime import Runtime


@dataclass(frozen=True)
class MicroLoss:
    """One micro-batch's loss: backward runs on `value / divisor` (after loss scaling), and the
    step's reported loss is made from the `value`s (`Objective.finish`)."""

    value: torch.Tensor
    divisor: int | float = 1


class Objective(Protocol):
    def produce(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """The micro-batches the steps train on, made from the loader's (a producer may
        generate, score and hold them for several steps)."""
        ...

    def loss(self, model: nn.Module, batch: Batch) -> MicroLoss:
        """Forward of one micro-batch (under the caller's autocast) and its loss."""
        ...

    def eval_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """A held-out batch's loss, forward only."""
        ...

    def finish(self, loss_sum: torch.Tensor, micro_batches: int) -> torch.Tensor:
        """After the last backward: the step's loss on this rank from the sum of its micro-batch
        `value`s (the engine then averages it over the ranks)."""
        ...

    def figures(self) -> dict:
        """What the objective measured in the step, for its record (empty: nothing)."""
        ...


def loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The batch's mean next-token loss, computed by the model (full or chunked: model/loss.py);
    positions (document packing) go in only when present."""
    if batch.positions is None:
        return model(batch.inputs, targets=batch.targets)
    return model(batch.inputs, batch.positions, targets=batch.targets)


def masked_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The summed next-token loss of the batch's trained targets (`loss_mask`; none: all): the
    others are `IGNORE`, so they add nothing and their logits get no gradient."""
    targets = batch.targets if batch.loss_mask is None else torch.where(batch.loss_mask, batch.targets, IGNORE)
    if batch.positions is None:
        return model(batch.inputs, targets=targets, masked=True)
    return model(batch.inputs, batch.positions, targets=targets, masked=True)


def trained_tokens(batch: Batch) -> int:
    return batch.targets.numel() if batch.loss_mask is None else int(batch.loss_mask.sum())


class NextTokenLoss:
    """Pre-training: every token predicts the next; the step's loss is the mean of its
    micro-batches' mean losses (they hold the same number of tokens), each micro-batch carrying
    1 / `micro_batches` of the gradient."""

    def __init__(self, micro_batches: int):
        self.micro_batches = micro_batches

    def produce(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        return batches

    def loss(self, model: nn.Module, batch: Batch) -> MicroLoss:
        return MicroLoss(loss_of(model, batch), self.micro_batches)

    def eval_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return loss_of(model, batch)

    def finish(self, loss_sum: torch.Tensor, micro_batches: int) -> torch.Tensor:
        return loss_sum / micro_batches

    def figures(self) -> dict:
        return {}


class MaskedTokenLoss:
    """Supervised fine-tuning: only the targets of a batch's `loss_mask` are trained (the
    assistant's turns, a completion), and the step's loss is their mean over the whole global
    batch: the sum over every trained token of every micro-batch and data-parallel rank, over
    their count. So a micro-batch holding one trained token weighs one token, not one
    micro-batch (the accumulation bug of per-micro-batch means), and padding or prompts weigh
    nothing.

    `produce` reads each step's micro-batches ahead and all-reduces their count; each rank's
    backward runs on its sum over count / dp, which the data-parallel gradient average turns
    into the global mean. A step without a trained token trains nothing (its loss is 0).
    """

    def __init__(self, micro_batches: int, rt: Runtime):
        self.micro_batches, self.rt = micro_batches, rt
        self.count = 0
        self.divisor = 1.0

    def produce(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        rt = self.rt
        while True:
            step = [next(batches) for _ in range(self.micro_batches)]
            local = torch.tensor(float(sum(trained_tokens(b) for b in step)), device=rt.device)
            # Tensor- and context-parallel ranks read the same batches: their copies count once.
            self.count = round(rt.all_reduce_mean(local, over=rt.dims.tp * rt.dims.cp).item())
            # The gradient is averaged over dp x cp ranks (cp ranks each hold a share of the tokens).
            self.divisor = max(self.count, 1) / (rt.dims.dp * rt.dims.cp)
            yield from step

    def loss(self, model: nn.Module, batch: Batch) -> MicroLoss:
        return MicroLoss(masked_loss_sum(model, batch), self.divisor)

    def eval_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return masked_loss_sum(model, batch) / max(trained_tokens(batch), 1)

    def finish(self, loss_sum: torch.Tensor, micro_batches: int) -> torch.Tensor:
        return loss_sum / self.divisor

    def figures(self) -> dict:
        return {"trained_tokens": self.count}
