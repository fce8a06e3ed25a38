"""A mixture of experts in training: its balancing (config/moe.py) and its expert load.

`Experts` is one of the step's parts (train/step.py). Each step begins by zeroing what the
routers add up (`begin`); each micro-batch's balancing loss, with `aux_loss`, joins the backward
(`aux_term`: the mean over every MoE layer of the model, times the coefficient, over the
micro-batches, as the main loss is shared out); after the update, with `bias`, each router's
selection bias moves towards the mean load, from the tokens every expert got over the whole step
on every rank (`end_step`: one all-reduce of a (layers, experts) table). Under activation
checkpointing the recompute adds nothing (model/moe.py), so the counts are those of the forwards.

What it reports, at the logging cadence, per MoE layer (`report`, from the sums of every rank's
`take`: StepReports gathers them with the step's other figures in one collective), over the
steps since the last record:
- `tokens`: the (token, choice) pairs each expert got, all ranks;
- `imbalance`: max / mean of those (1: even; E / k: every token sent to the same k experts);
- `entropy`: the mean entropy (nats) of a token's normalised router scores (ln E: undecided;
  0: certain);
- `idle_frac`: the share of experts that got no token at all;
- `aux_loss`: the balancing loss's mean, with `aux_loss` on (else None).
A layer's row of the sums is [tokens per expert..., entropy sum, tokens, aux sum, aux count];
ranks without the layer (another pipeline stage) add zeros, and data-parallel ranks' tokens add
up (tensor parallel is refused for experts: no rank holds a copy of another's counts).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from trainbook.config.model import ModelConfig
from trainbook.config.moe import MoeConfig
from trainbook.model.moe import Router, is_moe_layer
from trainbook.parallel.runtime import Runtime

_LAYER = re.compile(r"(?:.*\.)?layers\.(\d+)\.feed_forward\.router")
EXTRA = 4  # entropy sum, tokens, aux sum, aux count after each layer's tokens per expert


class Experts:
    def __init__(self, model: nn.Module, cfg: ModelConfig, moe: MoeConfig, rt: Runtime, micro_batches: int):
        self.rt, self.balance, self.micro_batches = rt, moe.balance, micro_batches
        self.coef, self.rate = moe.aux_loss_coef, moe.bias_update_rate
        self.n_experts = cfg.n_experts
        self.layers = [i for i in range(cfg.n_layers) if is_moe_layer(cfg, i)]
        """Every MoE layer of the model (this rank's and the other stages'), in order."""
        row = {layer: i for i, layer in enumerate(self.layers)}
        self.routers: list[tuple[int, Router]] = []
        """(row of `layers`, router) for this rank's MoE layers."""
        for name, module in model.named_modules():
            match = _LAYER.fullmatch(name)
            if isinstance(module, Router) and match:
                self.routers.append((row[int(match.group(1))], module))
                module.aux_loss = self.balance == "aux_loss"
        self.sums = torch.zeros(len(self.layers), self.n_experts + EXTRA, dtype=torch.float64, device=rt.device)

    def begin(self) -> None:
        """A step begins: nothing of it counted yet."""
        for _, router in self.routers:
            router.reset()

    def aux_term(self) -> torch.Tensor | None:
        """After a micro-batch's forward, with `aux_loss`: its share of the balancing loss (the
        MoE layers' mean x coefficient / micro-batches), what backward adds to the main loss."""
        if self.balance != "aux_loss":
            return None
        terms = [router.aux for _, router in self.routers if router.aux is not None]
        for _, router in self.routers:
            router.aux = None
        if not terms:
            return None
        return torch.stack(terms).sum() * (self.coef / (len(self.layers) * self.micro_batches))

    @torch.no_grad()
    def end_step(self, updated: bool) -> None:
        """After the step (`updated`: the optimizer stepped, on every rank alike): the bias moves
        (with `bias`), and the step's tallies join the sums `take` reports."""
        n = self.n_experts
        for row, router in self.routers:  # device-side adds only: no host sync in the step
            self.sums[row, :n] += router.tally
            self.sums[row, n] += router.entropy_sum
            self.sums[row, n + 1] += router.tokens
            self.sums[row, n + 2] += router.aux_sum
            self.sums[row, n + 3] += router.aux_count
        if self.balance != "bias" or not updated:
            return
        load = torch.zeros(len(self.layers), n, dtype=torch.int64, device=self.rt.device)
        for row, router in self.routers:
            load[row] += router.tally
        if self.rt.distributed:
            dist.all_reduce(load)  # every rank's tokens; other stages' layers add zeros here
        load = load.double()
        for row, router in self.routers:
            # up for an expert under the mean load, down for one over it (DeepSeek-V3)
            router.expert_bias += self.rate * torch.sign(load[row].mean() - load[row]).float()

    def take(self) -> list[float]:
        """This rank's sums since the last take, flat (the same length on every rank), then zeroed."""
        out = self.sums.flatten().tolist()
        self.sums.zero_()
        return out

    def report(self, sums: list[float]) -> dict[str, dict]:
        """Every rank's `take` added up -> the expert load of each MoE layer (`layers.N`)."""
        width = self.n_experts + EXTRA
        out = {}
        for i, layer in enumerate(self.layers):
            row = sums[i * width:(i + 1) * width]
            tokens = [int(round(t)) for t in row[: self.n_experts]]
            entropy_sum, count, aux_sum, aux_count = row[self.n_experts:]
            mean = sum(tokens) / self.n_experts
            out[f"layers.{layer}"] = {
                "tokens": tokens,
                "imbalance": round(max(tokens) / mean, 4) if mean > 0 else None,
                "entropy": round(entropy_sum / count, 4) if count else None,
                "idle_frac": round(sum(t == 0 for t in tokens) / self.n_experts, 4),
                "aux_loss": round(aux_sum / aux_count, 6) if aux_count else None,
            }
        return out

