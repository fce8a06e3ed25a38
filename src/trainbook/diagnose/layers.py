"""Per-layer statistics every `monitor.layer_stats_every` steps: where gradients, weights and
activations are heading, block by block, before a loss curve shows anything.

For each block ("embed", "layers.0", ..., "norm", "output") and each optimizer parameter group
("decay", "no_decay"):
- `grad_norm`: the L2 norm of the gradients before clipping (the block norms compose to the
  step's reported `grad_norm`);
- `param_norm`: the L2 norm of the weights before the update;
- `update_ratio`: ||W_after - W_before|| / ||W_before||, the relative size of the step (AdamW
  steps of ~1e-3 of the weight are healthy; 1e-1 is a model being rewritten);
and, for blocks, statistics of the block's output over every token of the step (all micro-batches,
all data-parallel ranks): `act_mean`, `act_std`, `act_max_abs`, `act_zero_frac`.

Every value is global. The norm of a sharded parameter or gradient (FSDP, TP, both) is taken
through DTensor's own reduction, as gradient clipping takes it: it knows which shards to sum
(placements such as a 2-D FSDP x TP weight's, or the Replicate gradient torch gives a
tensor-parallel embedding, are its business). Activations are summed over the data-parallel ranks and over the
tensor-parallel ones, which each hold a slice of the sequence between blocks (sequence parallel,
parallel/apply.py). Pipeline stages each measure their own blocks; rank 0 merges them.

The hooks cost nothing on other steps: the forward hooks return at once unless armed, and the
reductions run only on due steps. Under `train.compile` the hooks are kept out of dynamo:
torch runs a compiled block's hooks as frames of their own, and a traced hook would be guarded on
the arming and the running sums, and recompiled as they change (or have its helpers compiled).
Eager, they read the compiled forward's output: arming them compiles nothing, training is bitwise
that of a compiled run without statistics, and the statistics differ from the eager run's only as
the compiled block outputs do (inductor's float32 reordering, well under 1e-5 relative).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from trainbook.diagnose.blocks import block_of, block_order, squared_norm, unwrapped
from trainbook.monitor.report import LayerReport
from trainbook.parallel.runtime import Runtime

class _ActStats:
    """Running sums of one block's output over a step: count, sum, sum of squares, max |x|, zeros."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)  # count, sum, sumsq, zeros
        self.max_abs = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor) -> None:
        x = x.detach()
        xd = x.double()
        self.sums += torch.stack([
            torch.tensor(x.numel(), dtype=torch.float64, device=x.device), xd.sum(),
            xd.square().sum(), (x == 0).sum().double()])
        self.max_abs = torch.maximum(self.max_abs, xd.abs().max())


class LayerStats:
    """Attach to a model (its blocks) and an optimizer; call `arm` at the start of a due step,
    `observe_grads` before clipping, `before_update` before the optimizer step and `finish` after
    it, on every rank (the reductions are collectives)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, rt: Runtime,
                 every: int, copies: tuple = (),
                 training_forward: Callable[[], bool] = torch.is_grad_enabled):
        """`copies`: parameters another rank holds and reports too (a pipeline's last-stage copy
        of a tied embedding); they are left out, so nothing is counted twice.
        `training_forward`: whether a forward running now is a training step's (the engine says)."""
        self.training_forward = training_forward
        self.rt = rt
        self.every = every
        self.device = rt.device
        skip = {id(p) for p in copies}
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in skip]
        group_of = {}
        for group in optimizer.param_groups:
            name = "decay" if group.get("weight_decay", 0.0) > 0 else "no_decay"
            for p in group["params"]:
                group_of[id(p)] = name
        self.group_of = [group_of.get(id(p), "frozen") for _, p in self.named]
        self.block_of = [block_of(n) for n, _ in self.named]
        self.armed = False
        self.acts: dict[str, _ActStats] = {}
        self.hooks = []
        for name, module in model.named_modules():
            parts = unwrapped(name)
            if len(parts) >= 2 and parts[-2] == "layers" and parts[-1].isdigit():
                self.hooks.append(module.register_forward_hook(self._hook(f"layers.{parts[-1]}")))
        self._grad_sq: list[torch.Tensor] | None = None
        self._before: list[torch.Tensor] | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def _hook(self, block: str) -> Callable:
        @torch.compiler.disable  # never traced under train.compile: arming compiles nothing (above)
        def hook(module, args, output):
            # Training forwards only: not an evaluation, not a pipeline's shape inference.
            if not self.armed or not self.training_forward():
                return
            out = output[0] if isinstance(output, tuple) else output
            if block not in self.acts:
                self.acts[block] = _ActStats(out.device)
            self.acts[block].add(out)
        return hook

    def arm(self) -> None:
        """The next forwards (this step's) feed the activation statistics."""
        self.armed = True
        self.acts = {}

    def observe_grads(self) -> None:
        """Gradients are final (reduced, unscaled) and not yet clipped: measure them."""
        if not self.armed:
            return
        self._grad_sq = [squared_norm(p.grad, self.device) for _, p in self.named]

    def before_update(self) -> None:
        """A copy of the weights as they are before the optimizer step (this rank's shards: one
        more copy of them, on due steps only)."""
        if self.armed:
            self._before = [p.detach().clone() for _, p in self.named]

    def finish(self, step: int) -> LayerReport | None:
        """After the optimizer step: reduce everything; rank 0 gets the report, others None."""
        if not self.armed:
            return None
        self.armed = False
        params = [p for _, p in self.named]
        if self._before is None:  # the step was skipped (fp16 overflow): weights unchanged
            self._before = [p.detach().clone() for p in params]
        before, n = self._before, len(params)
        grad_sq = self._grad_sq or [squared_norm(None, self.device)] * n
        squares = torch.stack(grad_sq + [squared_norm(b, self.device) for b in before]
                              + [squared_norm(p.detach() - b, self.device) for p, b in zip(params, before)])
        self._grad_sq, self._before = None, None
        values = squares.tolist()  # one device sync for all of them
        rows = list(zip(values[:n], values[n:2 * n], values[2 * n:]))
        coord = self.rt.dims.coordinate(self.rt.rank)
        mine = {
            "blocks": _sum_by(self.block_of, rows), "groups": _sum_by(self.group_of, rows),
            "acts": self._activations(),
            # One rank per pipeline stage speaks for it (the others hold the same global sums).
            "speaks": coord["tp"] == 0 and coord["cp"] == 0 and self.rt.dp_rank == 0,
        }
        parts = [mine]
        if self.rt.distributed:
            parts = [None] * self.rt.world_size
            dist.all_gather_object(parts, mine)
        if not self.rt.is_main:
            return None
        blocks: dict[str, dict] = {}
        groups: dict[str, list[float]] = {}
        for part in parts:
            if not part["speaks"]:
                continue
            for key, value in part["blocks"].items():
                blocks.setdefault(key, {}).update(_norms(value))
            for key, value in part["acts"].items():
                blocks.setdefault(key, {}).update(value)
            for key, value in part["groups"].items():  # a group spans stages: add them up
                groups[key] = [a + b for a, b in zip(groups.get(key, [0.0, 0.0, 0.0]), value)]
        return LayerReport(step=step, blocks=dict(sorted(blocks.items(), key=lambda kv: block_order(kv[0]))),
                           groups={k: _norms(v) for k, v in sorted(groups.items())}, time=time.time())

    def _activations(self) -> dict:
        if not self.acts:
            return {}
        names = sorted(self.acts)
        sums = torch.stack([self.acts[b].sums for b in names])
        max_abs = torch.stack([self.acts[b].max_abs for b in names])
        if self.rt.distributed:
            # Data-parallel ranks saw other samples; tensor- and context-parallel ones hold other
            # positions of the sequence (between blocks the residual stream is sequence-sharded,
            # parallel/apply.py; cp ranks hold their share of each sequence, parallel/cp.py).
            sizes = self.rt.dims.sizes()
            for dim in ("dp_replicate", "dp_shard", "cp", "tp"):
                if sizes[dim] == 1:
                    continue
                group = self.rt.mesh[dim].get_group()
                dist.all_reduce(sums, group=group)
                dist.all_reduce(max_abs, op=dist.ReduceOp.MAX, group=group)
        out = {}
        for b, (count, total, sq, zeros), m in zip(names, sums.tolist(), max_abs.tolist()):
            mean = total / count
            out[b] = {"act_mean": mean, "act_std": math.sqrt(max(sq / count - mean * mean, 0.0)),
                      "act_max_abs": m, "act_zero_frac": zeros / count}
        return out

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def _sum_by(keys: list[str], rows: list[tuple[float, float, float]]) -> dict[str, list[float]]:
    """(grad², param², update²) summed per key."""
    out: dict[str, list[float]] = {}
    for key, row in zip(keys, rows):
        acc = out.setdefault(key, [0.0, 0.0, 0.0])
        for i, v in enumerate(row):
            acc[i] += v
    return out


def _norms(sq: list[float]) -> dict[str, float]:
    grad, param, update = (math.sqrt(v) for v in sq)
    return {"grad_norm": grad, "param_norm": param, "update_ratio": update / param if param > 0 else 0.0}
