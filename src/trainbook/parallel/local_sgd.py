"""Delayed synchronisation (`parallel.sync_every = H`): local SGD and DiLoCo on torch.distributed.

Each DDP replica trains on its own data with its own (inner) optimizer and sends no gradients.
Every H steps the replicas take one outer step together: each all-reduces its change since the
last synchronisation, the pseudo-gradient `anchor - weights` (the anchor being the weights all
replicas held then), and every replica applies the same outer step to the anchor:

- `average` (local SGD, Stich 2018): the new weights are the replicas' average (anchor minus the
  mean pseudo-gradient);
- `nesterov` (DiLoCo, Douillard et al. 2023): SGD with Nesterov momentum on the mean pseudo-
  gradient, `outer_lr` (0.7) and `outer_momentum` (0.9).

One all-reduce of every weight per H steps, against one of every gradient per step.

The trainer also synchronises before a checkpoint, at the last step and on a stop
(`sync(step, force=True)`), so a checkpoint holds one model (the anchor) that `sample` and `export`
read as any other. What differs between ranks is kept per rank: each replica's inner optimizer
moments (`local.rank{R}.optim.*`). The outer momentum is the same on every rank (`outer.*`). A run
killed after a checkpoint resumes the outer loop where it was, bitwise.

torchft ships LocalSGD and DiLoCo, but on its own Manager (a lighthouse quorum server, its own
process groups and recovery), which would stand beside the elastic agent that restarts trainbook's
workers; this is the same algorithm on the run's data-parallel group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainbook.config import ParallelConfig
from trainbook.faults import fault_active


class OuterLoop:
    """The outer step of `params` over `group` every `p.sync_every` steps."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, p: ParallelConfig):
        self.sync_every, self.group = p.sync_every, group
        self.named = [(name, q) for name, q in model.named_parameters() if q.requires_grad]
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        with torch.no_grad():
            for _, q in self.named:  # every replica starts from rank 0's weights (as DDP's own start)
                group.broadcast([q.data], opts).wait()
        self.anchor = [q.detach().clone() for _, q in self.named]
        lr, momentum = (1.0, 0.0) if p.outer_optimizer == "average" else (p.outer_lr, p.outer_momentum)
        self.outer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.bytes = sum(q.numel() * q.element_size() for q in self.anchor)
        """What one synchronisation all-reduces per rank."""

    def due(self, step: int) -> bool:
        return step % self.sync_every == 0

    @torch.no_grad()
    def sync(self, step: int, force: bool = False) -> bool:
        """After step `step`'s update: the outer step if it is due (or `force`d); whether it ran.
        The `comm.skip_outer` fault skips it (the replicas never meet again: a broken remedy)."""
        if not (force or self.due(step)) or fault_active("comm.skip_outer", step):
            return False
        flat = torch.cat([(a - q).reshape(-1) for a, (_, q) in zip(self.anchor, self.named, strict=True)])
        self.group.allreduce([flat]).wait()  # the group's own call: it may be a CountingGroup
        flat /= self.group.size()
        at = 0
        for a in self.anchor:
            a.grad = flat[at:at + a.numel()].view_as(a)
            at += a.numel()
        self.outer.step()
        for a, (_, q) in zip(self.anchor, self.named, strict=True):
            a.grad = None
            q.copy_(a)
        return True

    # ---- checkpoints: the outer momentum (the same on every rank)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: self.outer.state[a]["momentum_buffer"] for a, (name, _) in zip(self.anchor, self.named, strict=True)
                if self.outer.state.get(a, {}).get("momentum_buffer") is not None}

    def state_like(self, keys: set[str]) -> dict[str, torch.Tensor]:
        return {name: torch.zeros_like(a) for a, (name, _) in zip(self.anchor, self.named, strict=True) if name in keys}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """After the model's weights are loaded (a checkpoint's weights are the anchor)."""
        with torch.no_grad():
            for a, (name, q) in zip(self.anchor, self.named, strict=True):
                a.copy_(q)
                if name in state:
                    self.outer.state[a] = {"momentum_buffer": state[name].clone()}
