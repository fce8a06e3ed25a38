"""One rank of the context-parallel test (tests/dist/test_cp.py; torch.distributed.run, gloo).

    python -m tests.dist.cp_worker OUT_DIR DP_SHARD

On DP_SHARD x 2 ranks (cp = 2, FSDP over dp_shard x cp), every rank trains two copies of each case's
model in fp64 for 3 AdamW steps on the same global batch of 4 sequences: `ref`, the whole model on
the whole batch in this process, and `cp`, the trainer's layout (`parallelize`, the engine that
deals each sequence's positions to the cp ranks) on its data-parallel rank's rows. Cases: the tiny
Llama with head-tail balancing and without, with documents packed into the windows, and with full
and selective activation checkpointing; a tiny Qwen3 (q/k norms, a head_dim of its own); multi-head
latent attention (its values narrower than its keys).

Written to OUT_DIR/rank{R}.pt, per case: per step both losses (cp's as every rank reports it) and
gradient norms; step 1's logits of this rank's rows, cp's put back in sequence order (each rank's
share gathered over cp); after the steps every parameter of both, whole.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainbook.config import ModelConfig, OptimConfig, PrecisionConfig
from trainbook.data.samples import Batch
from trainbook.model import build_model, resolve
from trainbook.parallel.apply import ApplyOptions, parallelize
from trainbook.parallel.cp import local_index
from trainbook.parallel.dims import ParallelDims
from trainbook.parallel.runtime import Runtime, end_process
from trainbook.phase import PhaseTracker
from trainbook.precision import LossScaler, Precision
from trainbook.train.engine import LocalEngine
from trainbook.train.objective import NextTokenLoss
from trainbook.train.optim import build_optimizer

VOCAB, BATCH, SEQ, STEPS = 64, 4, 32, 3
OPTIM = OptimConfig(lr=1e-3)
MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_kv_heads=4)
CASES = {  # name -> (model, cp_load_balance, packed documents, activation checkpointing)
    "llama-head-tail": (ModelConfig(name="debug", vocab_size=VOCAB), "head_tail", False, "none"),
    "llama-contiguous": (ModelConfig(name="debug", vocab_size=VOCAB), "none", False, "none"),
    "llama-documents": (ModelConfig(name="debug", vocab_size=VOCAB), "head_tail", True, "none"),
    "qwen3": (ModelConfig(name="qwen3-tiny", vocab_size=VOCAB, n_layers=2), "head_tail", True, "none"),
    "mla": (ModelConfig(name="debug", vocab_size=VOCAB, **MLA), "head_tail", True, "none"),
    # Recomputed blocks gather the keys and values again in backward (full), or keep what the
    # selective policy saves.
    "llama-full-ac": (ModelConfig(name="debug", vocab_size=VOCAB), "head_tail", True, "full"),
    "llama-selective-ac": (ModelConfig(name="debug", vocab_size=VOCAB), "head_tail", True, "selective"),
}


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def batch(step: int, documents: bool) -> Batch:
    """4 sequences of SEQ tokens; with `documents`, each window holds documents of uneven lengths
    (positions restart at 0 where one starts), a document crossing the cp ranks' shares."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    positions = None
    if documents:
        rows = []
        for row in range(BATCH):
            cuts = sorted(torch.randperm(SEQ - 1, generator=g)[: row + 1].add(1).tolist())
            lengths = [b - a for a, b in zip([0, *cuts], [*cuts, SEQ])]
            rows.append(torch.cat([torch.arange(n) for n in lengths]))
        positions = torch.stack(rows)
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), positions)


def rows_of(b: Batch, rows: slice) -> Batch:
    return Batch(*(None if t is None else t[rows] for t in b))


def main() -> None:
    out, dp_shard = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, tp=1, pp=1, cp=2)
    rt = Runtime(rank, world, dims, torch.device("cpu"), mesh=dims.build_mesh("cpu"))
    alone = Runtime(0, 1, ParallelDims(1, 1, 1, 1), torch.device("cpu"))
    precision = Precision(PrecisionConfig(dtype="fp32"), "cpu")
    per_rank = BATCH // dims.dp
    mine = slice(rt.dp_rank * per_rank, (rt.dp_rank + 1) * per_rank)
    cp_rank = dims.coordinate(rank)["cp"]
    results = {}
    for case, (model_cfg, balance, documents, ac) in CASES.items():
        cfg = resolve(model_cfg)
        ref = build_model(cfg, "cpu", seed=0).double()
        cp = parallelize(build_model(cfg, "cpu", seed=0).double(), dims, rt.mesh,
                         ApplyOptions(cp_load_balance=balance, activation_checkpoint=ac))
        runs = {}
        for name, model, run_rt, rows in (("ref", ref, alone, mine), ("cp", cp, rt, mine)):
            engine = LocalEngine(model, precision, run_rt, PhaseTracker())
            optimizer = build_optimizer(model, OPTIM)
            objective, scaler = NextTokenLoss(1), LossScaler(enabled=False)
            steps = []
            for step in range(1, STEPS + 1):
                b = rows_of(batch(step, documents), rows) if name == "cp" else batch(step, documents)
                if step == 1:
                    with torch.no_grad():
                        local = engine.shard(b)
                        logits = model(local.inputs, local.positions)
                    if name == "cp":  # every cp rank's share, back in sequence order
                        shares = [torch.empty_like(logits) for _ in range(2)]
                        dist.all_gather(shares, logits.contiguous(), group=rt.mesh["cp"].get_group())
                        ordered = torch.empty(logits.shape[0], SEQ, VOCAB, dtype=logits.dtype)
                        for r, share in enumerate(shares):
                            ordered[:, local_index(SEQ, 2, r, balance)] = share
                        logits = ordered
                    else:
                        logits = logits[mine]
                loss = engine.forward_backward(b, objective, scaler)
                norm = engine.clip_grad_norm(1.0)
                optimizer.step()
                optimizer.zero_grad()
                steps.append({"loss": engine.report_loss(loss).item(), "grad_norm": norm.item()})
            runs[name] = {"steps": steps, "logits": logits,
                          "state": {k: whole(v) for k, v in model.state_dict().items()}}
        runs["cp_rank"] = cp_rank
        results[case] = runs
    torch.save(results, out / f"rank{rank}.pt")
    end_process(0)


if __name__ == "__main__":
    main()
