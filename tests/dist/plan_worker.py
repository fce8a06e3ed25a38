"""One rank of the plan test (started by torch.distributed.run, gloo backend).

    plan_worker.py OUT_DIR CASES_JSON CASE [CASE ...]

CASES_JSON maps a case name to recipe overrides (on recipes/tiny-shakespeare.toml). For each case
on the same process group: build this rank's part of the model exactly as the trainer does
(`Trainer._build_model`: the whole model from the seed, then the pipeline stages and/or
`parallelize`), its AdamW optimizer (`build_optimizer`), run one forward + backward + optimizer
step on a fixed batch (this data-parallel rank's rows), then one more forward + backward under
saved-tensor hooks, and write OUT_DIR/<case>-rank<R>.json: per parameter name, the bytes of the
local shard of the parameter, of its gradient and of each optimizer state tensor this rank
actually holds; and the bytes autograd saved for backward in that pass (`SavedBytes`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from trainbook.parallel.runtime import Runtime
from trainbook.precision import Precision
from trainbook.train.optim import build_optimizer
from trainbook.commands.resolve import resolve
from trainbook.phase import PhaseTracker
from trainbook.train.engine import lm_loss
from trainbook.train.trainer import Trainer

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-shakespeare.toml"


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of `t` (a DTensor's local shard, or the tensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the distinct storages autograd saves for backward while active: activations only
    (parameters, their views, FSDP's gathered parameters and the RoPE buffers are not counted)."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.skip = {b.untyped_storage().data_ptr() for m in modules for b in m.buffers()}
        self.seen: dict[int, int] = {}
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if not isinstance(base, torch.nn.Parameter):  # a parameter or a view of one: not counted
            inner = t
            while hasattr(inner, "__tensor_flatten__"):  # DTensor, AsyncCollectiveTensor: the plain tensor
                inner = getattr(inner, inner.__tensor_flatten__()[0][0])
            storage = inner.untyped_storage()
            if storage.data_ptr() not in self.skip:
                self.seen[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def run_case(name: str, overrides: list[str], out_dir: Path) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    res = resolve(RECIPE, overrides, world)
    cfg, dims = res.cfg, res.dims
    device = torch.device("cpu")
    rt = Runtime(rank, world, dims, device, mesh=dims.build_mesh("cpu"))
    # The trainer's own build path (it reads only these attributes of the trainer).
    fsdp = dims.dp > 1 and cfg.parallel.data_parallel == "fsdp"
    engine = Trainer._build_engine(SimpleNamespace(cfg=cfg, rt=rt, device=device, tracker=PhaseTracker(),
                                                   precision=Precision(cfg.precision, device, fsdp=fsdp)))
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
            else:
                lm_loss(model(inputs), targets).backward()

    forward_backward()
    optimizer.step()  # creates the optimizer state
    # A second pass, measured: a pipeline infers its shapes in the first (one more forward).
    # Every pack happens in forward; GPipe runs all micro-batches' forwards before any
    # backward, so no saved storage is freed (and its address reused) while counting.
    saved = SavedBytes(pipeline.modules if pipeline is not None else [model])
    with saved:
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
    dist.destroy_process_group()
    # gloo can abort at interpreter exit after all work is done (DESIGN.md): skip the teardown.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
