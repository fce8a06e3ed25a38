"""One rank of the pipeline-parallel tests (started by torch.distributed.run, gloo backend).

    pipeline_worker.py OUT_DIR CASE [CASE ...]      CASE = SCHEDULE:STAGES_PER_RANK:TIED[:DP_SHARD]

For each case, on the same process group: cut the debug model into a pipeline of pp = world /
DP_SHARD ranks, FSDP2-shard each stage over DP_SHARD ranks when DP_SHARD > 1 (each data-parallel
rank then reads its own half of every batch), train STEPS optimizer steps of ACCUM passes each on
the fixed batches of `batches()`, and write OUT_DIR/<case>-rank<R>.pt: the per-step losses (on the
last stage), gradient norms, eval losses after each step, and this rank's parameters
(full tensors, keyed by their names in the whole model).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainbook.config import Config, ModelConfig, ParallelConfig, TrainConfig
from trainbook.model import build_model, resolve
from trainbook.parallel.dims import resolve_dims
from trainbook.parallel.pipeline import build_pipeline
from trainbook.parallel.runtime import end_process
from trainbook.train.engine import lm_loss

STEPS, ACCUM, B, T, VOCAB, LR, CLIP = 3, 2, 4, 16, 128, 1e-2, 0.5


def model_config(tied: bool) -> ModelConfig:
    return resolve(ModelConfig(name="debug", n_layers=4, vocab_size=VOCAB, tie_embeddings=tied))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS * ACCUM (inputs, targets) pairs of (B, T) tokens, then one held-out pair."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (STEPS * ACCUM + 1, B, T + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def run_case(case: str, out_dir: Path) -> None:
    schedule, per_rank, tied, *rest = case.split(":")
    dp_shard = int(rest[0]) if rest else 1
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = Config(
        model=model_config(tied == "tied"),
        train=TrainConfig(seq_len=T, micro_batch_size=B // dp_shard),
        parallel=ParallelConfig(pp=-1, dp_shard=dp_shard, pp_schedule=schedule,
                                pp_stages_per_rank=int(per_rank)),
    )
    dims = resolve_dims(cfg.parallel, world, where="test")
    mesh = dims.build_mesh("cpu")
    coord = dims.coordinate(rank)
    model = build_model(cfg.model, "cpu", seed=0)

    shard_stage = None
    if dp_shard > 1:
        from torch.distributed.fsdp import fully_shard

        def shard_stage(stage):  # FSDP2 per block, then the stage's root (as parallel/apply.py)
            for block in stage.layers.values():
                fully_shard(block, mesh=mesh["dp_shard"])
            return fully_shard(stage, mesh=mesh["dp_shard"])

    pipe = build_pipeline(model, dims, mesh["pp"], coord["pp"], cfg.parallel, torch.device("cpu"), lm_loss,
                          parallelize_stage=shard_stage)
    del model
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    data = batches()
    # Data-parallel rank d reads rows [d * B / dp, (d + 1) * B / dp) of every batch.
    rows = slice(coord["dp_shard"] * B // dp_shard, (coord["dp_shard"] + 1) * B // dp_shard)

    losses, norms, evals, shared = [], [], [], []
    for step in range(STEPS):
        step_loss = []
        for k in range(ACCUM):
            inputs, targets = data[step * ACCUM + k]
            loss = pipe.step(inputs[rows], targets[rows], accum_steps=ACCUM)
            step_loss.append(loss)
        norms.append(pipe.clip_grad_norm_(CLIP).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Eval after every step: the schedule switches train -> eval -> train each time.
        eval_loss = pipe.eval_loss(*(t[rows] for t in data[-1]))
        shared.append(pipe.share(eval_loss).item())
        if pipe.has_last:
            losses.append((sum(step_loss) / ACCUM).item())
            evals.append(eval_loss.item())

    params = {}
    for module in pipe.modules:
        for name, p in module.named_parameters():
            params[name] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
    out = {"rank": rank, "coord": coord, "layers": [list(r) for r in pipe.layers], "losses": losses,
           "norms": norms, "evals": evals, "shared_evals": shared, "params": params}
    torch.save(out, out_dir / f"{case.replace(':', '-')}-rank{rank}.pt")
    dist.barrier()


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    for case in sys.argv[2:]:
        run_case(case, out_dir)
    end_process(0)


if __name__ == "__main__":
    main()
