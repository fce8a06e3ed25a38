"""One rank of the expert-parallel test (tests/dist/test_ep.py; torch.distributed.run, 2 processes,
gloo).

    python -m tests.dist.ep_worker OUT_DIR

Every rank trains two copies of one tiny MoE (tiny-moe's shape, 64-token vocabulary, every router
with a selection bias balanced by DeepSeek-V3's rule; in fp64, the routers in fp32 as always) for 3
AdamW steps on the same global batch:
`ref`, the whole model on the whole batch in this process, and `ep`, the trainer's layout for
parallel.ep = 2 (`parallelize`: experts 0-3 on rank 0 and 4-7 on rank 1, tokens exchanged by
all-to-all, FSDP over both ranks for the rest; activation checkpointing on, so each block's
recompute exchanges again) on this rank's half of the batch. In step 2 every router's bias sends
each token to experts 0 and 1, so rank 1's experts get no token from any rank.

Written to OUT_DIR/rank{R}.pt (plain tensors and numbers): per step, both losses (ep's averaged
over the ranks), gradient norms and the experts' gradient norm before clipping, the tokens per
expert each router counted (summed over the ranks for ep), each rank's tokens received; after
the steps, every parameter and buffer of both, whole. Then the checkpoint round trip: the ep
model's state (model and AdamW moments) saved at ep = 2 (OUT_DIR/ckpt/step-3), loaded into the
same model under plain FSDP (ep = 1) and saved again (step-4), loaded back at ep = 2; the saved
state and each load's, whole, are written beside the others for the test to compare bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from trainbook.checkpoint import Checkpointer, load_state, tensor_entries
from trainbook.config import CheckpointConfig, ModelConfig, OptimConfig
from trainbook.config.moe import MoeConfig
from trainbook.model import build_model, resolve
from trainbook.model.moe import MoE, Router
from trainbook.parallel.apply import ApplyOptions, parallelize
from trainbook.parallel.dims import ParallelDims
from trainbook.parallel.runtime import Runtime, end_process
from trainbook.train.engine import clip_grad_norm
from trainbook.train.experts import Experts
from trainbook.train.optim import build_optimizer, optimizer_state, optimizer_state_like

VOCAB, BATCH, SEQ, STEPS, IDLE_STEP = 64, 4, 16, 3, 2
CFG = resolve(ModelConfig(name="tiny-moe", vocab_size=VOCAB, router_bias=True))
OPTIM = OptimConfig(lr=1e-3)
BIAS = MoeConfig(balance="bias", bias_update_rate=1e-3)


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))


def expert_norm(model) -> float:
    grads = [p.grad for n, p in model.named_parameters() if ".experts." in n]
    return torch.linalg.vector_norm(torch.stack([whole(g).norm() for g in grads])).item()


def routers(model) -> list[Router]:
    return [m for m in model.modules() if isinstance(m, Router)]


def train_step(model, optimizer, experts: Experts, tokens: torch.Tensor, step: int, rt: Runtime) -> dict:
    optimizer.zero_grad()
    experts.begin()
    if step == IDLE_STEP:  # every token to experts 0 and 1: rank 1's experts idle
        for router in routers(model):
            router.expert_bias[:2] += 100.0
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    if step == IDLE_STEP:
        for router in routers(model):
            router.expert_bias[:2] -= 100.0
    experts_norm = expert_norm(model)
    norm = clip_grad_norm(list(model.parameters()), 1.0)
    optimizer.step()
    counts = torch.stack([r.tally for r in routers(model)])
    experts.end_step(True)
    return {"loss": rt.all_reduce_mean(loss, over=rt.world_size).item(), "grad_norm": norm.item(),
            "experts_grad_norm": experts_norm, "counts": counts}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, pp=1, ep=2)
    rt = Runtime(rank, 2, dims, torch.device("cpu"), mesh=dims.build_mesh("cpu"))
    alone = Runtime(0, 1, ParallelDims(1, 1, 1, 1), torch.device("cpu"))

    ref = build_model(CFG, "cpu", seed=0).double()
    ep = parallelize(build_model(CFG, "cpu", seed=0).double(), dims, rt.mesh, ApplyOptions(activation_checkpoint="full"))
    received = []
    for module in ep.modules():
        if isinstance(module, MoE):
            exchange = module.exchange
            module.experts.register_forward_pre_hook(lambda _m, args: received.append(args[0].shape[0]))
            assert exchange is not None and module.experts.w1.to_local().shape[0] == CFG.n_experts // 2
    runs = {}
    for name, model, run_rt, rows in (("ref", ref, alone, slice(None)), ("ep", ep, rt, slice(2 * rank, 2 * rank + 2))):
        optimizer = build_optimizer(model, OPTIM)
        experts = Experts(model, CFG, BIAS, run_rt, micro_batches=1)
        steps = []
        for step in range(1, STEPS + 1):
            received.clear()
            record = train_step(model, optimizer, experts, batch(step)[rows], step, run_rt)
            if name == "ep":
                dist.all_reduce(record["counts"])
                record["received"] = list(received)
            steps.append(record)
        runs[name] = {"steps": steps, "state": {k: whole(v) for k, v in model.state_dict().items()}}
        runs[name]["optimizer"] = optimizer
    torch.save({k: {"steps": v["steps"], "state": v["state"]} for k, v in runs.items()}, out / f"rank{rank}.pt")

    # The checkpoint round trip: ep = 2 -> ep = 1 (FSDP only) -> ep = 2.
    def state_of(model, optimizer) -> dict:
        return {"model": model.state_dict(), "optim": optimizer_state(model, optimizer)}

    def save(model, optimizer, step: int) -> None:
        saver = Checkpointer(out / "ckpt", CheckpointConfig(mode="sync", keep_last=5), rank=rank, world_size=2)
        saver.save(step, {**state_of(model, optimizer), "trainer": {"step": torch.tensor(step)}})
        saver.close()
        dist.barrier()  # rank 0 finishes the checkpoint (its manifest) after the collective save

    def load(layout: ParallelDims, step: int):
        model = parallelize(build_model(CFG, "cpu", seed=rank + 7).double(), layout, layout.build_mesh("cpu"), ApplyOptions())
        optimizer = build_optimizer(model, OPTIM)
        ckpt = out / "ckpt" / f"step-{step}"
        state = {"model": model.state_dict(), "optim": optimizer_state_like(model, tensor_entries(ckpt))}
        load_state(ckpt, state)
        for name, p in model.named_parameters():
            optimizer.state[p] = state["optim"][name]
        loaded = state_of(model, optimizer)
        torch.save({part: {k: (whole(v) if isinstance(v, torch.Tensor) else {s: whole(t) for s, t in v.items()})
                           for k, v in loaded[part].items()} for part in loaded}, out / f"loaded{step}-rank{rank}.pt")
        return model, optimizer

    save(ep, runs["ep"]["optimizer"], 3)
    model, optimizer = load(ParallelDims(1, 2, 1, 1, ep=1), 3)
    save(model, optimizer, 4)
    load(dims, 4)
    whole_state = {part: {k: (whole(v) if isinstance(v, torch.Tensor) else {s: whole(t) for s, t in v.items()})
                          for k, v in state_of(ep, runs["ep"]["optimizer"])[part].items()}
                   for part in ("model", "optim")}
    torch.save(whole_state, out / f"saved-rank{rank}.pt")
    end_process(0)


if __name__ == "__main__":
    main()
