"""What a rank holds in memory, measured: parameters, gradients and optimizer states (this rank's
local shards), FSDP's gathered copies apart, and with `[diagnose] memory_history` the bytes each
block saved for backward. And what an allocation failure looks like, on every device.
"""

from __future__ import annotations

import re
import types
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainbook.diagnose.blocks import block_index

# The allocators' own words: CPU (c10's DefaultCPUAllocator, a plain RuntimeError), CUDA and NPU
# (torch.OutOfMemoryError, or a RuntimeError from older builds and extensions).
OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory", "NPU out of memory",
                "out of memory")


def out_of_memory_error(error: BaseException) -> BaseException | None:
    """The allocation failure behind `error` (itself, or what it was raised from), or None."""
    seen = 0
    while error is not None and seen < 4:
        if isinstance(error, torch.OutOfMemoryError):
            return error
        if isinstance(error, RuntimeError) and any(m in str(error) for m in OOM_MESSAGES):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def requested_bytes(error: BaseException) -> int | None:
    """The size of the allocation that failed, when the allocator says it."""
    text = str(error)
    cpu = re.search(r"you tried to allocate (\d+) bytes", text)
    if cpu:
        return int(cpu.group(1))
    cuda = re.search(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)", text)
    if cuda:
        scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[cuda.group(2)]
        return int(float(cuda.group(1)) * scale)
    return None


def blocks_of(model: nn.Module) -> dict[str, nn.Module]:
    """"block <i>" -> the module of transformer block i that this rank holds (under activation
    checkpointing the wrapper, whose forward runs the block)."""
    out = {}
    for name, module in model.named_modules():
        index = block_index(name)
        if index is not None:
            out[f"block {index}"] = module
    return out


def failing_block(error: BaseException, blocks: dict[str, nn.Module]) -> str | None:
    """The innermost block whose forward was running where `error` was raised (read from the
    traceback's frames: free until a failure). None outside any block (the loss, backward, the
    optimizer), where the phase says enough."""
    by_id = {id(m): name for name, m in blocks.items()}
    found = None
    tb: types.TracebackType | None = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in by_id:
            found = by_id[id(owner)]
        tb = tb.tb_next
    return found


def _local_bytes(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t._local_tensor  # this rank's shard
    return t.numel() * t.element_size()


def _fsdp_params(model: nn.Module) -> list:
    """FSDP2's per-parameter records (torch's internal FSDPParam) of every fully_shard-ed module."""
    out = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
        if group is not None:
            out += list(group.fsdp_params)
    return out


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds now: `parameters`, `gradients` and `optimizer` states (local shards of
    DTensors: what this rank stores), and `fsdp_gathered`: FSDP's all-gathered full copies of the
    blocks being computed (and their unsharded gradients before the reduce-scatter), which exist
    only around a block's forward or backward and are counted apart from the shards."""
    params = grads = gathered = 0
    managed: set[int] = set()
    try:
        records = _fsdp_params(model)
    except (AttributeError, RuntimeError):  # another torch's internals: count what parameters show
        records = []
    for record in records:
        sharded = record.sharded_param
        unsharded = getattr(record, "_unsharded_param", None)
        managed.update({id(sharded), id(unsharded)})
        params += _local_bytes(sharded)
        grads += _local_bytes(sharded.grad) if sharded.grad is not None else 0
        gathered += sum(t.untyped_storage().nbytes() for t in getattr(record, "all_gather_outputs", ()))
        if unsharded is not None and unsharded.grad is not None:
            gathered += _local_bytes(unsharded.grad)
    for p in model.parameters():
        if id(p) in managed:
            continue
        params += _local_bytes(p)
        grads += _local_bytes(p.grad) if p.grad is not None else 0
    optim = sum(_local_bytes(v) for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor))
    return {"parameters": params, "gradients": grads, "optimizer": optim, "fsdp_gathered": gathered}


class SavedActivations:
    """Bytes each block saves for backward in the micro-batch being computed, measured with
    saved-tensor hooks (exact, on every device): the activations a block holds until its
    backward. Counted once per storage; parameters are not activations. Reset when the first of
    `blocks` starts a training forward, so after a failure the counts are those of the micro-batch
    that failed, up to the failure. Never used under `train.compile` (diagnose/oom.py): its hooks
    are plain eager code, and the class imports no compiler (a worker's start-up stays short)."""

    def __init__(self, blocks: dict[str, nn.Module]):
        self.bytes = dict.fromkeys(blocks, 0)
        self._seen: set[int] = set()
        self._active: list = []  # saved_tensors_hooks contexts entered by blocks still running
        self._handles = []
        for i, (name, block) in enumerate(blocks.items()):
            self._handles.append(block.register_forward_pre_hook(partial(self._enter, name, i == 0)))
            self._handles.append(block.register_forward_hook(self._exit))

    def _enter(self, name: str, first: bool, module: nn.Module, args) -> None:
        if not torch.is_grad_enabled():
            return
        if first:
            self.bytes = dict.fromkeys(self.bytes, 0)
            self._seen.clear()
        hooks = torch.autograd.graph.saved_tensors_hooks(partial(self._pack, name), _unpack)
        hooks.__enter__()
        self._active.append(hooks)

    def _exit(self, module: nn.Module, args, output) -> None:
        if self._active and torch.is_grad_enabled():
            self._active.pop().__exit__(None, None, None)

    def _pack(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            local = t._local_tensor if isinstance(t, DTensor) else t
            storage = local.untyped_storage()
            if storage.data_ptr() not in self._seen:
                self._seen.add(storage.data_ptr())
                self.bytes[name] += storage.nbytes()
        return t

    def abandon(self) -> None:
        """After a failure inside a block its forward hook never ran: leave autograd's hook stack
        as it was before."""
        while self._active:
            self._active.pop().__exit__(None, None, None)

    def close(self) -> None:
        self.abandon()
        for handle in self._handles:
            handle.remove()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
