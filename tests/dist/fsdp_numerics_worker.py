"""One rank of tests/dist/test_fsdp_numerics.py (torch.distributed.run, gloo): the debug model
under FSDP2 x 2 as `parallelize` applies it (`apply_fsdp`, the precision's `fsdp_policy`).

    python -m torch.distributed.run ... -m tests.dist.fsdp_numerics_worker OUT_DIR

(as a module, from the repository root, so that it reads the op log of tests/unit/train/
test_precision.py). Writes OUT_DIR/rank<R>.pt:
- "checkpointing": per `train.activation_checkpoint` mode, fp32, this rank's rows of one batch:
  `run_pass`'s loss, every parameter's whole gradient, and its op counts;
- "fp32_ops": per low-precision dtype, per positions (none, or two documents per row): the op log
  of a forward under that dtype's FSDP2 policy, and the dtypes each block received
  (h, cos, sin);
- "reduce_bf16": `run_pass` of the fp32 model with gradients reduce-scattered in bf16
  (parallel.reduce_dtype), and the dtypes of the sharded gradients the optimizer reads.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker

from trainbook.config.model import ModelConfig
from trainbook.model import build_model, resolve
from trainbook.parallel.apply import ApplyOptions, parallelize
from trainbook.parallel.dims import ParallelDims
from trainbook.parallel.runtime import end_process
from trainbook.precision import fsdp_policy
from trainbook.train.engine import lm_loss

MODES = ("none", "full", "selective")
# What a block's recomputation shows: its matmuls, the norms' statistics, the attention kernel.
COUNTED = ("mm", "rsqrt", "_scaled_dot_product_flash_attention_for_cpu")


def debug_model() -> torch.nn.Module:
    return build_model(resolve(ModelConfig(name="debug")), "cpu", seed=0)


class OpCounts(TorchDispatchMode):
    """How many times each COUNTED op ran inside the blocks' forward (`forward`) and anywhere in
    backward (`backward`). Outer to checkpointing's own modes, it sees what really runs: selective
    checkpointing's cache answers the ops it saved without running them."""

    def __init__(self, blocks):
        super().__init__()
        self.inside, self.in_backward = 0, False
        self.forward: Counter = Counter()
        self.backward: Counter = Counter()
        for block in blocks:
            block.register_forward_pre_hook(lambda *a: setattr(self, "inside", self.inside + 1))
            block.register_forward_hook(lambda *a: setattr(self, "inside", self.inside - 1))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in COUNTED and (self.in_backward or self.inside):
            (self.backward if self.in_backward else self.forward)[name] += 1
        return func(*args, **(kwargs or {}))


def run_pass(model: torch.nn.Module, tokens: torch.Tensor) -> dict:
    """One forward + backward of lm_loss on `tokens` (B, T + 1): the loss, every parameter's
    gradient (whole, gathered from FSDP's shards) and the op counts (`OpCounts`)."""
    counts = OpCounts(model.layers.values())
    with counts:
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        counts.in_backward = True
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grads[name] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
    return {"loss": loss.detach(), "grads": grads, "forward": dict(counts.forward), "backward": dict(counts.backward)}


def block_inputs(model: torch.nn.Module) -> list:
    """Each block's positional input dtypes per call, as the block (after FSDP's hooks) gets them."""
    seen = []
    for block in model.layers.values():
        block.register_forward_pre_hook(
            lambda m, args: seen.append([a.dtype if isinstance(a, torch.Tensor) else None for a in args]))
    return seen


def main() -> None:
    from tests.unit.train.test_precision import OpLog, trace_inputs

    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, pp=1)
    mesh = dims.build_mesh("cpu")
    result: dict = {"checkpointing": {}, "fp32_ops": {}}

    batch = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    for mode in MODES:
        model = parallelize(debug_model(), dims, mesh, ApplyOptions(mode, data_parallel="fsdp",
                                                                    mp_policy=fsdp_policy("fp32")))
        result["checkpointing"][mode] = run_pass(model, batch[2 * rank:2 * rank + 2])

    # parallel.reduce_dtype = "bf16": the same pass, its gradients reduce-scattered in bf16.
    model = parallelize(debug_model(), dims, mesh, ApplyOptions(data_parallel="fsdp",
                                                                mp_policy=fsdp_policy("fp32", "bf16")))
    result["reduce_bf16"] = run_pass(model, batch[2 * rank:2 * rank + 2])
    result["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})

    tokens, positions = trace_inputs()
    for dtype in ("bf16", "fp16"):
        model = parallelize(debug_model(), dims, mesh, ApplyOptions(data_parallel="fsdp",
                                                                    mp_policy=fsdp_policy(dtype)))
        received, traces = block_inputs(model), []
        for pos in positions:
            received.clear()
            with ModuleTracker() as tracker, OpLog(tracker) as log:
                loss = lm_loss(model(tokens[:, :-1], pos), tokens[:, 1:])
            loss.backward()  # a whole step, as training runs it (FSDP's state ends where it began)
            traces.append({"ops": log.ops, "block_inputs": list(received)})
        result["fp32_ops"][dtype] = traces

    torch.save(result, out_dir / f"rank{rank}.pt")
    end_process(0)


if __name__ == "__main__":
    main()
