"""Pipeline parallel: cut the model into stages, wrap them in `torch.distributed.pipelining`.

Each of the `pp` ranks of a pipeline group holds `pp_stages_per_rank` stages, numbered loop-style:
rank r holds stages r, r + pp, r + 2 pp, ... (what torch's schedules expect: stage i runs on
rank i % pp). A stage is a copy of the Llama with only its blocks left; stage 0 keeps
`tok_embeddings` and takes token ids (B, T), later stages take hidden states (B, T, dim); the last
stage keeps `norm` and `output` and returns logits (B, T, V), earlier ones return hidden states.

Gradients. A pass (`Pipeline.step`) cuts a (micro_batch_size, T) batch into `n_microbatches`
equal chunks along the batch. torch's schedules by default divide every `.grad` by n_microbatches
at the end of each pass (`scale_grads=True`), which is right for one pass per optimizer step but
wrong with gradient accumulation: the second pass divides the first pass's gradients again. So we
build the schedules with `scale_grads=False` and scale the loss instead: each chunk's loss is
`loss_fn(chunk) / (n_microbatches * accum_steps)`. Chunks hold equal token counts, so the sum over
chunks and passes is the mean loss over the whole optimizer step, exactly what `Step`
back-propagates on one device (`lm_loss(batch) / accum_steps` per pass).

Tied embeddings (`model.tie_embeddings`). With pp > 1 stage 0 (embedding) and the last stage
(output head) always live on different ranks, so one tensor cannot serve both. We keep the tie
the way Megatron-LM does: each side holds a copy (equal at the start, since both are cut from the
same model), and after the last pass of an optimizer step (`accum_steps` passes) the two ranks
exchange the copies' gradients and both use the sum: the gradient of the tied parameter. Equal
weights + equal gradients + the same optimizer keep the copies bitwise equal. `clip_grad_norm_`
counts that gradient once, like the single-device model.

Composing with TP/FSDP (`parallelize_stage`): it is applied to each stage module *before* its
`PipelineStage` is built, as torchtitan does. `PipelineStage` infers activation shapes by running
the first chunk (dynamic metadata inference, again whenever the schedule switches between train
and eval), so it must see the module as it will run: with sequence-parallel TP, hidden states
cross stages as local sequence shards (B, T / tp, dim). The schedules run FSDP's post-backward
(reduce-scatter) themselves at the end of each pass, so FSDP communicates once per pass, not once
per optimizer step. torch 2.13 gives a TP (Shard(0)) embedding a Replicate gradient;
the tied-gradient exchange redistributes it to the parameter's layout first.

Context parallelism (`parallel.cp`): the engine hands the pipeline each cp rank's share of the
sequences (train/engine.py) and every stage, given no positions, takes its share's global ones from
its ContextParallel (model/llama.py), so only the share's hidden states travel between stages; not
with tensor parallel too (a later stage would receive a sequence-parallel piece of the share).

Not supported: document packing (`positions` would have to travel with the activations).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from trainbook.config import ParallelConfig
from trainbook.errors import TrainbookError
from trainbook.parallel.dims import ParallelDims, pipeline_microbatches

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def stage_layers(
    n_layers: int,
    n_stages: int,
    split: list[int] | None,
    layer_params: list[int],
    *,
    first_params: int = 0,
    last_params: int = 0,
) -> list[range]:
    """The block indices each stage holds, contiguous and in order: `split[i]` layers for stage i,
    or, without a split, balanced by parameter count.

    Balanced rule: stage i's weight is the sum of `layer_params` of its blocks, plus `first_params`
    (the embedding) on stage 0 and `last_params` (final norm + output head) on the last stage. The
    split minimises the heaviest stage, then the sum of squared stage weights (more even); among
    splits still equal, later stages get more layers (1F1B keeps the most micro-batches in flight
    on the first stage, so it has the most activations to hold). Deterministic, every stage holds
    at least one layer.
    """
    if split is not None:
        if len(split) != n_stages or any(n < 1 for n in split) or sum(split) != n_layers:
            raise TrainbookError(
                f"{split} must be {n_stages} positive layer counts (one per stage) adding up to "
                f"{n_layers} layers", where="parallel.pp_split")
        bounds = [0]
        for n in split:
            bounds.append(bounds[-1] + n)
        return [range(bounds[i], bounds[i + 1]) for i in range(n_stages)]
    assert len(layer_params) == n_layers, (len(layer_params), n_layers)
    if n_layers < n_stages:
        raise TrainbookError(f"{n_stages} pipeline stages need at least {n_stages} layers; the model "
                             f"has {n_layers}", where="parallel.pp")

    prefix = [0]
    for p in layer_params:
        prefix.append(prefix[-1] + p)

    def weight(stage: int, lo: int, hi: int) -> int:
        w = prefix[hi] - prefix[lo]
        w += first_params if stage == 0 else 0
        return w + (last_params if stage == n_stages - 1 else 0)

    # best[k][i]: (heaviest, sum of squares) of the best split of layers [0, i) into k + 1 stages;
    # cut[k][i]: where stage k starts in it. Iterating starts upwards and keeping only strict
    # improvements gives ties to the earliest start of the later stage (later stages larger).
    inf = (math.inf, math.inf)
    best = [[inf] * (n_layers + 1) for _ in range(n_stages)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages)]
    for i in range(1, n_layers + 1):
        w = weight(0, 0, i)
        best[0][i] = (w, w * w)
    for k in range(1, n_stages):
        for i in range(k + 1, n_layers + 1):
            for j in range(k, i):
                heaviest, squares = best[k - 1][j]
                w = weight(k, j, i)
                cand = (max(heaviest, w), squares + w * w)
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    bounds, hi = [n_layers], n_layers
    for k in range(n_stages - 1, 0, -1):
        hi = cut[k][hi]
        bounds.append(hi)
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[i], bounds[i + 1]) for i in range(n_stages)]


def model_stage_layers(model: nn.Module, n_stages: int, split: list[int] | None) -> list[range]:
    """`stage_layers` for a Llama (on any device, meta included): parameters counted from it."""
    layer_params = [sum(p.numel() for p in block.parameters()) for block in model.layers.values()]
    first = model.tok_embeddings.weight.numel()
    # A tied head is a separate copy on the last stage (see the module docstring): count it there.
    last = sum(p.numel() for p in model.norm.parameters()) + model.output.weight.numel()
    return stage_layers(len(layer_params), n_stages, split, layer_params,
                        first_params=first, last_params=last)


@dataclass(frozen=True)
class StageSpec:
    index: int
    layers: range
    """The block indices this stage holds."""
    is_first: bool
    """Holds the embedding, takes token ids."""
    is_last: bool
    """Holds the final norm and the head, returns logits."""

    def pp_rank(self, pp: int) -> int:
        """The pipeline rank holding this stage (loop-style: stage i on rank i % pp)."""
        return self.index % pp


def assign_stages(model: nn.Module, pp: int, parallel: ParallelConfig) -> list[StageSpec]:
    """Every stage of a `pp`-rank pipeline, in order: the one place stages get their layers and
    their rank (`plan` and `build_pipeline` both read it)."""
    n_stages = pp * parallel.pp_stages_per_rank
    layers = model_stage_layers(model, n_stages, parallel.pp_split)
    return [StageSpec(i, layers[i], i == 0, i == n_stages - 1) for i in range(n_stages)]


def rank_stages(
    model: nn.Module, pp: int, pp_rank: int, parallel: ParallelConfig,
    parallelize_stage: Callable[[nn.Module], nn.Module] | None = None,
) -> list[tuple[StageSpec, nn.Module]]:
    """The stages pipeline rank `pp_rank` holds, each cut from `model` (and parallelized)."""
    out = []
    for spec in assign_stages(model, pp, parallel):
        if spec.pp_rank(pp) == pp_rank:
            module = cut_stage(model, spec.layers, spec.is_first, spec.is_last)
            out.append((spec, parallelize_stage(module) if parallelize_stage is not None else module))
    return out


def cut_stage(model: nn.Module, layers: range, is_first: bool, is_last: bool) -> nn.Module:
    """A deep copy of `model` holding only blocks `layers` (keys keep their global numbers, so
    parameter names match the whole model's), the embedding only if first, norm and head only if
    last. `model` is left unchanged; only the stage's own parts are copied."""
    saved = {name: getattr(model, name) for name in ("layers", "tok_embeddings", "norm", "output")}
    try:
        # Swap the unwanted parts out for the copy, so deepcopy never touches them.
        model.layers = nn.ModuleDict({str(i): saved["layers"][str(i)] for i in layers})
        model.tok_embeddings = saved["tok_embeddings"] if is_first else None
        model.norm = saved["norm"] if is_last else None
        model.output = saved["output"] if is_last else None
        stage = copy.deepcopy(model)
    finally:
        for name, module in saved.items():
            setattr(model, name, module)
    return stage


class Pipeline:
    """This rank's pipeline stages and the schedule that runs them. Built by `build_pipeline`."""

    def __init__(self, stages: list[PipelineStage], layers: list[range], schedule: str, n_microbatches: int,
                 group: dist.ProcessGroup, loss_fn: LossFn, tied: bool):
        self.stages = stages
        self.modules: list[nn.Module] = [s.submod for s in stages]
        """The stage modules this rank holds, in stage order (the optimizer takes their parameters)."""
        self.layers = layers
        """The block indices of each of this rank's stages."""
        self.n_microbatches = n_microbatches
        self.group = group
        self.has_first = stages[0].is_first
        self.has_last = stages[-1].is_last
        self._loss_fn = loss_fn
        self._loss_scale = 1.0  # set per pass: 1 / (n_microbatches * accum_steps)
        self._tied = tied
        self._passes = 0  # passes since the tied gradients were last summed
        self.computing = False
        """True while a stage runs a micro-batch's forward; False during the schedule's shape
        inference, which runs the stage on uninitialised tensors (observers must ignore it)."""
        for stage in stages:
            stage.forward_maybe_with_nosync = self._marking(stage.forward_maybe_with_nosync)
        # scale_grads=False: the loss carries 1/n_microbatches (see the module docstring).
        if schedule == "interleaved1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=self._scaled_loss,
                                                    scale_grads=False)
        else:
            kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
            self.schedule = kind(stages[0], n_microbatches, loss_fn=self._scaled_loss, scale_grads=False)

    def _marking(self, forward):
        def forward_chunk(*args, **kwargs):
            self.computing = True
            try:
                return forward(*args, **kwargs)
            finally:
                self.computing = False
        return forward_chunk

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of this rank's stages, each once."""
        seen: set[int] = set()
        for module in self.modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """What the schedule back-propagates for one chunk (see the module docstring)."""
        return self._loss_fn(output, target) * self._loss_scale

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, accum_steps: int = 1) -> torch.Tensor | None:
        """Forward and backward of one (micro_batch_size, T) batch through the pipeline.

        Adds to `.grad` this batch's share of the step's mean loss (as `(lm_loss / accum_steps)
        .backward()` does on one device). Every rank of the pipeline group calls it with the same
        batch (only stage 0 reads `inputs`, only the last stage `targets`). After the
        `accum_steps`-th call, tied embedding gradients are summed across their two ranks.
        Returns the batch's mean loss (detached, unscaled) on the rank holding the last stage,
        None elsewhere. Call it under `precision.autocast()` for mixed precision.
        """
        self._check_batch(inputs)
        self._loss_scale = 1.0 / (self.n_microbatches * accum_steps)
        losses: list[torch.Tensor] = []
        self.schedule.step(*self._args(inputs), **self._target(targets, losses), return_outputs=False)
        self._passes += 1
        if self._passes >= accum_steps:
            self._passes = 0
            self._sum_tied_grads()
        return self._mean(losses)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Mean loss of a batch, forward only (the schedule's `eval`): no gradients, nothing kept.

        Returns it on the rank holding the last stage, None elsewhere (`share` sends it to all).
        torch re-infers activation shapes when a schedule switches between train and eval, one
        extra forward (and backward, for train) of one chunk each time, and then drops the
        gradients of FSDP modules: call this between optimizer steps, not between their passes.
        """
        self._check_batch(inputs)
        self._loss_scale = 1.0 / self.n_microbatches
        losses: list[torch.Tensor] = []
        was_training = [m.training for m in self.modules]
        for m in self.modules:
            m.eval()
        self.schedule.eval(*self._args(inputs), **self._target(targets, losses), return_outputs=False)
        for m, mode in zip(self.modules, was_training):
            m.train(mode)
        return self._mean(losses)

    def share(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss on every rank of the pipeline group (a broadcast; for logging)."""
        if loss is None:
            loss = torch.zeros((), device=self.stages[0].device)
        last_rank = (self.stages[0].num_stages - 1) % dist.get_world_size(self.group)
        dist.broadcast(loss, group=self.group, group_src=last_rank)
        return loss

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient (all stages); returns that norm, the same
        on every pipeline rank. A tied head's gradient copy is counted once, as on one device."""
        params = list(self.parameters())
        counted = [p.grad for p in params if p.grad is not None and not self._is_tied_copy(p)]
        device = self.stages[0].device
        total = nn.utils.get_total_norm(counted, norm_type) if counted else torch.zeros((), device=device)
        if hasattr(total, "full_tensor"):  # a DTensor norm (FSDP/TP grads): reduce its shards
            total = total.full_tensor()
        total = total.to(torch.float32)
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.group)
        else:
            total = total ** norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
            total = total ** (1.0 / norm_type)
        nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    # ---- internals

    def _args(self, inputs: torch.Tensor) -> tuple:
        return (inputs,) if self.has_first else ()

    def _target(self, targets: torch.Tensor, losses: list) -> dict:
        return {"target": targets, "losses": losses} if self.has_last else {}

    def _mean(self, losses: list[torch.Tensor]) -> torch.Tensor | None:
        if not self.has_last:
            return None
        # Each entry is loss_chunk * scale; the chunks' mean is the batch's mean loss.
        return torch.stack([x.detach() for x in losses]).sum() / (self._loss_scale * len(losses))

    def _check_batch(self, inputs: torch.Tensor) -> None:
        if inputs.shape[0] % self.n_microbatches:
            raise TrainbookError(
                f"a batch of {inputs.shape[0]} rows cannot be cut into {self.n_microbatches} pipeline "
                "micro-batches", where="parallel.pp_microbatches")

    def tied_weight(self) -> nn.Parameter | None:
        """This rank's copy of a tied embedding/head matrix, if it holds one."""
        if not self._tied:
            return None
        if self.has_first:
            return self.modules[0].tok_embeddings.weight
        if self.has_last:
            return self.modules[-1].output.weight
        return None

    def _is_tied_copy(self, p: nn.Parameter) -> bool:
        # The head's copy is the one not counted in the norm (stage 0 counts the embedding's).
        return self._tied and self.has_last and p is self.modules[-1].output.weight

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        p = self.tied_weight()
        if p is None:
            return
        assert p.grad is not None, "tied embedding has no gradient after backward"
        if hasattr(p.grad, "placements") and p.grad.placements != p.placements:
            # torch 2.13: a TP (Shard(0)) embedding gets a Replicate gradient; the head's is
            # Shard(0). Match the parameter's layout so both sides exchange the same shard.
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # FSDP/TP: our shard
        peer = (self.stages[0].num_stages - 1) % dist.get_world_size(self.group) if self.has_first else 0
        received = torch.empty_like(grad)
        ops = [dist.P2POp(dist.isend, grad.contiguous(), group=self.group, group_peer=peer),
               dist.P2POp(dist.irecv, received, group=self.group, group_peer=peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        grad.add_(received)  # a + b == b + a bitwise: both copies get the same sum


class StageGroup(nn.Module):
    """This rank's stages seen as one module with the whole model's parameter names.

    The optimizer, checkpoints and reports use it: `layers.<i>` keeps its global index, and
    `tok_embeddings` / `norm` / `output` appear only where this rank holds them. It shares the
    stage modules' submodules (and so their parameters); it is never called.
    """

    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict({k: block for m in modules for k, block in m.layers.items()})
        for name in ("tok_embeddings", "norm", "output"):
            held = [getattr(m, name) for m in modules if getattr(m, name, None) is not None]
            if held:
                setattr(self, name, held[0])


def build_pipeline(
    model: nn.Module,
    dims: ParallelDims,
    pp_mesh_or_group,
    pp_rank: int,
    parallel: ParallelConfig,
    device: torch.device,
    loss_fn: LossFn,
    parallelize_stage: Callable[[nn.Module], nn.Module] | None = None,
) -> Pipeline:
    """This rank's stages of `model`, wrapped in `PipelineStage`s and the configured schedule.

    `model` is the whole Llama with its real weights (every pipeline rank builds the same one from
    the same seed, so every layout starts from the same init); it is not modified, and the caller
    may drop it afterwards. `pp_mesh_or_group` is the 1-D "pp" DeviceMesh or its process group;
    `pp_rank` this rank's index in it. `loss_fn(logits, targets)` is the mean loss of a chunk
    (`train.engine.lm_loss`). `parallelize_stage` applies TP/AC/compile/FSDP to each stage module
    before its `PipelineStage` is built. The layout was validated when the recipe was resolved.
    """
    p = parallel
    if dims.pp < 2:
        raise TrainbookError(f"a pipeline needs pp >= 2, got {dims.pp}", where="parallel.pp")
    group = pp_mesh_or_group.get_group() if hasattr(pp_mesh_or_group, "get_group") else pp_mesh_or_group
    n_stages = dims.pp * p.pp_stages_per_rank
    n_microbatches = pipeline_microbatches(p, dims.pp)
    mine = rank_stages(model, dims.pp, pp_rank, p, parallelize_stage)
    last = mine[-1][1]
    if mine[-1][0].is_last and getattr(last, "chunked_loss", None) is not None:
        # A chunked loss applies the head itself: the last stage hands it normed hidden states.
        last.hidden_out = True
        loss_fn = last.loss
    stages = [PipelineStage(module, spec.index, n_stages, device, group=group) for spec, module in mine]
    return Pipeline(stages, [spec.layers for spec, _ in mine], p.pp_schedule, n_microbatches, group, loss_fn,
                    tied=bool(model.cfg.tie_embeddings))
