"""One rank of the plan test (started by torch.distributed.run, gloo backend).

    plan_worker.py OUT_DIR CASES_JSON CASE [CASE ...]

CASES_JSON maps a case name to recipe overrides (on recipes/tiny-shakespeare.toml). For each case
on the same process group: build this rank's part of the model exactly as the trainer does
(`train/build.py`: the whole model from the seed, then the pipeline stages and/or
`parallelize`), its AdamW optimizer (`build_optimizer`), run one forward + backward + optimizer
step on a fixed batch (this data-parallel rank's rows), then one more forward + backward under
saved-tensor hooks, and write OUT_DIR/<case>-rank<R>.json: per parameter name, the bytes of the
local shard of the parameter, of its gradient and of each optimizer state tensor this rank
actually holds; and the most bytes kept for backward at once in that pass (`SavedBytes`).
"""

from __future__ import annotations

import contextlib
import json
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainbook.commands.resolve import resolve
from trainbook.data.samples import Batch
from trainbook.parallel.apply import _SAVE_OPS
from trainbook.parallel.compile import CompileChoice
from trainbook.parallel.runtime import Runtime, end_process
from trainbook.phase import PhaseTracker
from trainbook.precision import Precision
from trainbook.train.engine import lm_loss
from trainbook.train.optim import build_optimizer
from trainbook.train.build import build_engine, full_model, surgery

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-shakespeare.toml"


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of `t` (a DTensor's local shard, or the tensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class _Held:
    """What the pack hook hands autograd: the tensor, and what to call when autograd drops it
    (after that node's backward, or with its graph)."""

    __slots__ = ("tensor", "release")

    def __init__(self, tensor: torch.Tensor, release):
        self.tensor, self.release = tensor, release

    def __del__(self):
        self.release()


def _plain(t: torch.Tensor) -> torch.Tensor:
    while hasattr(t, "__tensor_flatten__"):  # DTensor, AsyncCollectiveTensor: the plain tensor
        t = getattr(t, t.__tensor_flatten__()[0][0])
    return t


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """The peak, while active, of the bytes of the distinct storages kept for backward: what
    autograd saves (parameters, their views, FSDP's gathered parameters and the RoPE buffers not
    counted), what selective checkpointing caches outside autograd (`selective`), and the output
    a pipeline stage holds until that micro-batch's backward (`stage_outputs`). A storage counts
    while anything holds it, so 1F1B's interleaved forwards and backwards are measured as they
    overlap. Not counted: a later stage's receive buffers, allocated once per micro-batch for
    the whole run (communication buffers; autograd saves them in fp32, and that counts)."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.skip = {b.untyped_storage().data_ptr() for m in modules for b in m.buffers()}
        self.modules = modules
        self.holders: dict[int, int] = {}  # storage address -> things holding it
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0
        self.group: list | None = None  # the running checkpointed block's [holders, done, cached]
        self.cached: _SelectiveCache | None = None
        super().__init__(self._pack, lambda held: held.tensor)

    @property
    def total(self) -> int:
        return self.peak

    def hold(self, t: torch.Tensor) -> int | None:
        storage = _plain(t).untyped_storage()
        key = storage.data_ptr()
        if key in self.skip:
            return None
        if key not in self.holders:
            self.holders[key], self.sizes[key] = 0, storage.nbytes()
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)
        self.holders[key] += 1
        return key

    def drop(self, key: int | None) -> None:
        if key is not None:
            self.holders[key] -= 1
            if not self.holders[key]:
                del self.holders[key]
                self.live -= self.sizes.pop(key)

    def _param_storages(self) -> set[int]:
        """The storages parameters have now (FSDP's gathered ones included; a DTensor parameter's
        local tensor, which expert parallelism's experts compute with, is one of them)."""
        return {_plain(p).untyped_storage().data_ptr() for m in self.modules for p in m.parameters()}

    def _pack(self, t: torch.Tensor) -> _Held:
        base = t._base if t._base is not None else t
        param = isinstance(base, torch.nn.Parameter) or _plain(t).untyped_storage().data_ptr() in self._param_storages()
        key = None if param else self.hold(t)
        group = self.group
        if group is None:
            return _Held(t, lambda: self.drop(key))
        group[0] += 1

        def release():
            self.drop(key)
            group[0] -= 1
            self._close(group)
        return _Held(t, release)

    def _close(self, group: list) -> None:
        # Selective checkpointing's cache belongs to the checkpoint of one block call, which
        # lives as long as what that call saved (its inputs): both go in the block's backward.
        if group[1] and group[0] == 0:
            for key in group[2]:
                self.drop(key)
            group[2] = []

    def selective(self, blocks) -> _SelectiveCache:
        """Count the outputs selective checkpointing keeps in `blocks` (apply._SAVE_OPS): enter
        the returned dispatch mode around the pass too."""
        for block in blocks:
            block.register_forward_pre_hook(lambda *a: setattr(self, "group", [0, False, []]))
            block.register_forward_hook(lambda *a: self._end_block())
        self.cached = _SelectiveCache(self)
        return self.cached

    def _end_block(self) -> None:
        group, self.group = self.group, None
        group[1] = True
        self._close(group)

    def stage_outputs(self, modules: list[torch.nn.Module]) -> None:
        """Count each pipeline stage's output for as long as it lives (the stage's cache)."""
        def hook(module, args, output):
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor):
                    weakref.finalize(t, self.drop, self.hold(t))
        for m in modules:
            m.register_forward_hook(hook)


class _SelectiveCache(TorchDispatchMode):
    """Outer to checkpointing's own mode, so it sees what that mode caches: the outputs of the
    ops it must save, inside a block's forward (its recomputation reads them from the cache)."""

    def __init__(self, saved: SavedBytes):
        super().__init__()
        self.saved = saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        group = self.saved.group
        if group is not None and func in _SAVE_OPS:
            group[2] += [self.saved.hold(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def run_case(name: str, overrides: list[str], out_dir: Path) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    res = resolve(RECIPE, overrides, world)
    # The trainer settles train.compile and train.loss before it builds (parallel/compile.py);
    # the plan is of the eager layout with full logits.
    cfg = CompileChoice(False, "full", "").settled(res.cfg)
    dims = res.dims
    device = torch.device("cpu")
    rt = Runtime(rank, world, dims, device, mesh=dims.build_mesh("cpu"))
    # The trainer's own build path (it reads only these attributes of the trainer).
    fsdp = dims.dp_cp > 1 and cfg.parallel.data_parallel == "fsdp"
    model, _ = surgery(full_model(cfg, device), cfg)
    engine = build_engine(model, cfg, rt, Precision(cfg.precision, device, fsdp=fsdp), PhaseTracker())
    model, pipeline = engine.model, getattr(engine, "pipeline", None)
    optimizer = build_optimizer(model, cfg.optim, embeddings=engine.embeddings)

    t, dp = cfg.train, dims.dp
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size * dp, t.seq_len + 1), generator=g)
    rows = tokens[rt.dp_rank * t.micro_batch_size:(rt.dp_rank + 1) * t.micro_batch_size]
    inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    precision = Precision(cfg.precision, device)

    def forward_backward() -> None:
        with precision.autocast():
            if pipeline is not None:
                pipeline.step(inputs, targets, accum_steps=1)
            else:  # under context parallelism this rank's share of each sequence
                local = engine.shard(Batch(inputs, targets))
                lm_loss(model(local.inputs, local.positions), local.targets).backward()

    forward_backward()
    optimizer.step()  # creates the optimizer state
    # A second pass, measured: a pipeline infers its shapes in the first (one more forward).
    modules = pipeline.modules if pipeline is not None else [model]
    saved = SavedBytes(modules)
    cached = contextlib.nullcontext()
    if cfg.train.activation_checkpoint == "selective":
        cached = saved.selective([b for m in modules for b in m.layers.values()])
    if pipeline is not None:
        saved.stage_outputs(modules)
    with saved, cached:
        forward_backward()

    params = {}
    for pname, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        params[pname] = {
            "param": local_bytes(p),
            "grad": local_bytes(p.grad) if p.grad is not None else 0,
            "optim": {k: local_bytes(v) for k, v in state.items()},
            "local_shape": list((p.to_local() if hasattr(p, "to_local") else p).shape),
        }
    out = {"rank": rank, "coord": dims.coordinate(rank), "params": params, "saved_bytes": saved.total}
    (out_dir / f"{name}-rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()


def main() -> None:
    out_dir, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for name in sys.argv[3:]:
        run_case(name, cases[name], out_dir)
    end_process(0)


if __name__ == "__main__":
    main()
