"""Apply a parallel layout to an unchanged model, from outside, in one function.

The order matters and is fixed:
1. tensor parallel (+ sequence parallel) or expert parallelism (parallel/ep.py): they swap
   parameters for DTensors sharded over `tp` or `ep`, which every later step must see as they will
   be at run time;
2. activation checkpointing: it wraps each block's forward, so it recomputes the tensor-parallel
   forward including its collectives;
3. torch.compile per block: it traces the block as checkpointed and tensor-parallel, and stops at
   block boundaries, where FSDP's hooks run; the model's loss is then chunked if asked
   (`train.loss`, model/loss.py), its chunk kernel compiled with the blocks;
4. data parallel last: FSDP2 `fully_shard` per block and then the root (or DDP `replicate`), so it
   shards whatever parameters TP left, over the data-parallel dimensions only; under expert
   parallelism each MoE layer's experts first, on their own mesh (the ranks holding the same
   experts).
Module paths never change (no wrapper modules), so checkpoints and optimizer state keep the names
of the single-device model.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trainbook.model.lora import LoRALinear
from trainbook.model.loss import ChunkedLoss
from trainbook.model.moe import Router
from trainbook.parallel.compression import CompressionSpec, CountingGroup, DDPCompression, count_reduce_scatter
from trainbook.parallel.cp import ContextParallel
from trainbook.parallel.dims import ParallelDims
from trainbook.parallel.local_sgd import OuterLoop
from trainbook.parallel.ep import apply_ep, expert_modules

# Ops whose outputs selective checkpointing keeps: matmuls and attention are expensive to
# recompute; norms, activations and elementwise ops are cheap and recomputed.
_SAVE_OPS = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


@dataclass(frozen=True)
class ApplyOptions:
    """What `parallelize` needs beyond the layout: from `[train]`, `[parallel]` and the precision
    policy."""

    activation_checkpoint: str = "none"
    """`none`, `full` or `selective` (train.activation_checkpoint)."""
    compile: bool = False
    """torch.compile each block (train.compile)."""
    data_parallel: str = "fsdp"
    """`fsdp` or `ddp` (parallel.data_parallel)."""
    mp_policy: Any = None
    """FSDP2's MixedPrecisionPolicy (Precision.fsdp_policy()); None: no casts."""
    loss: str = "full"
    """`chunked` or `full` (train.loss as parallel/compile.py settled it)."""
    cp_load_balance: str = "head_tail"
    """How a sequence's positions are dealt to the cp ranks (parallel.cp_load_balance)."""
    compression: CompressionSpec = CompressionSpec()
    """DDP's gradient compression and byte count (parallel/compression.py)."""
    local_sgd: Any = None
    """The ParallelConfig when `parallel.sync_every` > 0: replicas trained apart, an outer step
    every H steps (parallel/local_sgd.py) instead of DDP."""


def parallelize(model: nn.Module, dims: ParallelDims, mesh, opts: ApplyOptions) -> nn.Module:
    """Apply TP, activation checkpointing, compile and data parallel (in that order) in place."""
    if dims.tp > 1:
        apply_tp(model, mesh["tp"])
    expert_mesh = dims.expert_mesh(mesh) if dims.ep > 1 else None
    if expert_mesh is not None:
        apply_ep(model, expert_mesh["ep"])
    if opts.activation_checkpoint != "none":
        for block in model.layers.values():
            checkpoint_block(block, selective=opts.activation_checkpoint == "selective")
    if opts.compile:
        for block in model.layers.values():
            block.compile()
    if opts.loss == "chunked" and getattr(model, "output", None) is not None:
        model.chunked_loss = ChunkedLoss(compiled=opts.compile)
    if dims.cp > 1:
        model.context_parallel = ContextParallel(mesh["cp"], opts.cp_load_balance)
    if dims.dp_cp > 1:
        if opts.data_parallel == "ddp" and opts.local_sgd is not None:
            model.outer_loop = OuterLoop(model, ddp_group(model, mesh["dp_replicate"], opts.compression), opts.local_sgd)
        elif opts.data_parallel == "ddp":
            replicate_model(model, mesh["dp_replicate"], opts.compression)
        else:
            experts = None if expert_mesh is None else expert_dp_mesh(expert_mesh, dims)
            apply_fsdp(model, dp_mesh(mesh, dims), opts.mp_policy, experts)
            if opts.compression.count_bytes:
                model.grad_bytes = count_reduce_scatter(model)
    return model


def replicate_model(model: nn.Module, mesh, spec: CompressionSpec) -> None:
    """DDP (`replicate`) over `mesh`; with compression (or a byte count, or a slow link) trainbook's
    hook (`model.grad_compression`, whose state checkpoints keep), and with the byte count over a
    counting group (`model.grad_bytes`)."""
    from torch.distributed._composable import replicate

    if not spec.hooked:
        replicate(model, device_mesh=mesh)
        return
    group = ddp_group(model, mesh, spec)
    replicate(model, process_group=group)
    model.grad_compression = DDPCompression(spec, group)
    model.register_comm_hook(None, model.grad_compression.hook)


def ddp_group(model: nn.Module, mesh, spec: CompressionSpec) -> dist.ProcessGroup:
    """The replicas' process group; a counting one (`model.grad_bytes` when bytes are counted)
    for a byte count or a slow link."""
    group = mesh.get_group()
    if spec.wrapped:
        group = CountingGroup(group, spec.link_mbps)
        if spec.count_bytes:
            model.grad_bytes = group
    return group


def dp_mesh(mesh, dims: ParallelDims):
    """FSDP's mesh: 2-D (replicate, shard) for HSDP, else just the sharded dimension; under context
    parallelism the sharded dimension is dp_shard x cp flattened (cp ranks hold the same model and
    average their gradients, each having seen its share of the sequences)."""
    shard = "dp_shard"
    if dims.cp > 1:
        shard = "dp_shard_cp"
        flat = mesh["dp_shard", "cp"]._flatten(shard)  # again for the same mesh: the same dimension
        if dims.dp_replicate == 1:
            return flat  # (torch 2.13 warns when a flattened dimension is sliced from the root)
    return mesh["dp_replicate", shard] if dims.dp_replicate > 1 else mesh[shard]


def expert_dp_mesh(expert_mesh, dims: ParallelDims):
    """The experts' FSDP mesh: the ranks holding the same experts ((replicate, efsdp) for HSDP)."""
    return expert_mesh["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else expert_mesh["efsdp"]


def tp_plan(model: nn.Module) -> dict[str, object]:
    """Tensor-parallel styles keyed by module path (sequence parallel between the blocks).

    Between blocks the residual stream is sharded along the sequence (Shard(1)); each attention
    and feed-forward gathers it, splits heads / hidden units column-wise, and reduce-scatters back.
    The output head gathers the sequence and returns full logits on every tp rank.

    Entries follow the modules the model has (a family's options), never its name: q/k/v biases
    shard with their projections (ColwiseParallel splits a bias on dim 0 with the weight's rows);
    q/k norms, one gain of head_dim shared by every head, are replicated and see this rank's heads
    of the (B, T, heads, head_dim) q or k as a DTensor sharded on dim 2, so the gain's gradient,
    a sum over every position and head, is summed over tp like the block norms' over the sequence
    (the "replicated with gradient all-reduce" of torchtitan's Qwen3 and HF's tp plans); the norm
    returns the local heads, as the projection handed them over. A projection carrying a LoRA
    adapter gets the adapter-aware form of its style (the stock ones would shard every parameter
    beneath the module, the adapter's A and B included, by the base weight's rule).
    """
    def adapted(path: str) -> bool:
        return _has_module(model, path) and isinstance(model.get_submodule(path), LoRALinear)

    def colwise(path: str):
        return AdaptedColwise() if adapted(path) else ColwiseParallel()

    def rowwise(path: str):  # back to the sequence-sharded residual stream
        return (AdaptedRowwise if adapted(path) else RowwiseParallel)(output_layouts=Shard(1))

    plan: dict[str, object] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for name in model.layers:
        p = f"layers.{name}"
        plan.update({
            f"{p}.attention_norm": SequenceParallel(),
            # x, cos, sin, mask, kv: only x is a sequence-sharded tensor.
            f"{p}.attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                                 desired_input_layouts=(Replicate(), None, None, None, None)),
            f"{p}.attention.wq": colwise(f"{p}.attention.wq"),
            f"{p}.attention.wk": colwise(f"{p}.attention.wk"),
            f"{p}.attention.wv": colwise(f"{p}.attention.wv"),
            f"{p}.attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            f"{p}.attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            f"{p}.attention.wo": rowwise(f"{p}.attention.wo"),
            f"{p}.ffn_norm": SequenceParallel(),
            f"{p}.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{p}.feed_forward.w1": colwise(f"{p}.feed_forward.w1"),
            f"{p}.feed_forward.w3": colwise(f"{p}.feed_forward.w3"),
            f"{p}.feed_forward.w2": rowwise(f"{p}.feed_forward.w2"),
        })
    return {path: style for path, style in plan.items() if _has_module(model, path)}


class AdaptedColwise(ColwiseParallel):
    """ColwiseParallel for a `LoRALinear`: the base weight and bias and the adapter's B (out, r)
    split by output rows (Shard(0)), A (r, in) whole on every rank. The replicated input gives
    A x whole, B turns it into this rank's output columns, added to the base's."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name != "lora_a":  # A is left to distribute_module, which replicates it
            _shard_own(module, Shard(0), device_mesh, self.src_data_rank)


class AdaptedRowwise(RowwiseParallel):
    """RowwiseParallel for a `LoRALinear`: the base weight and A (r, in) split by input columns
    (Shard(1)), the bias and B (out, r) whole. This rank's input columns give a partial A x, B
    keeps it partial (it is linear), and the output's reduction sums it with the base's."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name in ("", "lora_a"):
            _shard_own(module, Shard(1), device_mesh, self.src_data_rank, only=("weight",))


def _shard_own(module: nn.Module, placement, device_mesh, src_data_rank, only=("weight", "bias")) -> None:
    """Swap `module`'s own parameters (not its children's) named in `only` for DTensors placed
    so, keeping requires_grad (the frozen base stays frozen)."""
    for key, param in list(module.named_parameters(recurse=False)):
        if key in only:
            dist = distribute_tensor(param.data, device_mesh, [placement], src_data_rank=src_data_rank)
            module.register_parameter(key, nn.Parameter(dist, requires_grad=param.requires_grad))


def _has_module(model: nn.Module, path: str) -> bool:
    try:
        return model.get_submodule(path) is not None
    except AttributeError:
        return False


def apply_tp(model: nn.Module, tp_mesh) -> None:
    tied = getattr(model, "output", None) is not None and model.tok_embeddings is not None and (
        model.output.weight is model.tok_embeddings.weight)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, tp_plan(model))
    for name, p in model.named_parameters():
        # SequenceParallel's replicated norms come back trainable; a frozen base (LoRA) stays frozen.
        p.requires_grad_(name not in frozen)
    if tied:
        # TP replaces each module's parameter with its own DTensor; both are Shard(0) over the
        # vocabulary, so the tie is restored by sharing the embedding's.
        model.output.weight = model.tok_embeddings.weight


def checkpoint_block(block: nn.Module, selective: bool) -> None:
    """Recompute the block's activations in backward (selective: all but matmul/attention outputs).
    A router in it keeps each forward's choice for the recompute (model/moe.py)."""
    for module in block.modules():
        if isinstance(module, Router):
            module.keep_choice = True
    forward = block.forward
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_policy) if selective else None
    kwargs = {"context_fn": context_fn} if context_fn else {}

    @functools.wraps(forward)
    def checkpointed(*args, **kw):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs, **kw)

    block.forward = checkpointed


def _save_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_fsdp(model: nn.Module, mesh, mp_policy=None, experts=None) -> None:
    """FSDP2 per block, then the root (embeddings, final norm, output head).

    `mp_policy`: the precision policy's (compute dtype for the gathered parameters, fp32 master
    weights, gradients reduced in fp32); None casts nothing. `experts`: under expert parallelism,
    the experts' mesh: each block's routed experts are sharded first, on that mesh, by their
    second dimension (the first is the expert, which ep splits), so each parameter is one plain
    2-D layout.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    # Blocks take the residual stream (already in the compute dtype: the embedding ran in it) and
    # the RoPE tables, which must stay fp32 (precision.FP32_OPS): no casting of block inputs, so
    # no block keeps a low-precision copy of the tables either (tests/dist/test_fsdp_numerics.py).
    block_mp = dataclasses.replace(mp, cast_forward_inputs=False)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = i < len(blocks) - 1
        for module in expert_modules(block) if experts is not None else ():
            fully_shard(module, mesh=experts, mp_policy=block_mp, reshard_after_forward=reshard,
                        shard_placement_fn=lambda _: Shard(1))
        fully_shard(block, mesh=mesh, mp_policy=block_mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp)
