"""`trainbook plan`: who holds what, how data and gradients flow, and memory per rank, for a layout.

No training process is started. Parameter placement is not re-derived by hand: the real
`parallelize` (and the pipeline's stage cutting) runs on a model built on the meta device, once per
rank coordinate, inside this process on PyTorch's *fake* process group (collectives that do
nothing), and the resulting DTensors are read: placements per mesh dimension, global and local
shapes. So FSDP2's padded dim-0 chunks, TP's column/row shards and their strided composition are
exactly what the trainer's ranks will hold. Parameters, gradients and optimizer states are exact
bytes (tests/dist/test_plan.py compares them with real gloo ranks); activations are an estimate
from a per-block formula of the decoder (compared with saved-tensor hooks in the same test).

Gradient layouts equal parameter layouts, with one exception torch 2.13 has: a tensor-parallel
(Shard(0)) embedding without FSDP gets a Replicate gradient (the full table on every tp rank),
unless the same tensor is the output head's (tied, pp = 1) or the pipeline's tied-gradient
exchange redistributes it (tied, pp > 1).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from trainbook.model import build_model, num_params
from trainbook.model.count import count
from trainbook.model.lora import apply_lora
from trainbook.parallel.dims import MESH_DIMS, ParallelDims, pipeline_microbatches
from trainbook.parallel.plan_comm import compression_remedies, gradient_path
from trainbook.parallel.plan_memory import PlanInputs, context_table, memory, numel, rank_of

ADAM_STEP_BYTES = 4  # AdamW's per-parameter `step`: a float32 scalar tensor
MAX_SIMULATED = 16  # distinct rank coordinates simulated one by one; beyond, a sample (see _coords)


# ---- placement: the real parallelize on a meta model, on a fake process group ------------------

def _placement_name(p) -> str:
    kind = type(p).__name__
    if kind == "Shard":
        return f"Shard({p.dim})"
    if kind == "_StridedShard":  # FSDP sharding the rows TP already split: rows of the tp shard
        return f"StridedShard({p.dim})"
    return {"Replicate": "Replicate", "Partial": "Partial"}.get(kind, str(p))


def _coords(dims: ParallelDims) -> list[dict[str, int]]:
    """The rank coordinates to simulate. dp_replicate never changes what a rank holds (replicas
    are copies), so its index is 0. All (pp, dp_shard, cp, tp) when few; else each pipeline rank at
    the first and last dp_shard/cp/tp index (the first holds the largest chunks, torch.chunk-style;
    FSDP shards over dp_shard x cp under context parallelism)."""
    sizes = dims.sizes()
    inner = ("dp_shard", "cp", "tp")
    if sizes["pp"] * sizes["dp_shard"] * sizes["cp"] * sizes["tp"] <= MAX_SIMULATED:
        shard, cp, tp = (range(sizes[k]) for k in inner)
    else:
        shard, cp, tp = (sorted({0, sizes[k] - 1}) for k in inner)
    return [{"pp": p, "dp_replicate": 0, "dp_shard": s, "cp": c, "tp": t}
            for p in range(sizes["pp"]) for s in shard for c in cp for t in tp]


_SIMULATED: dict[str, dict[int, dict]] = {}
"""`simulate`'s results in this process, by what placement depends on (`_placement_key`): a plan
whose micro-batch is `auto` places the model once for the choice and once for the plan."""


def _placement_key(cfg: PlanInputs, dims: ParallelDims) -> str:
    """What placement depends on: the layout, the model, the adapters, how blocks are wrapped,
    the dtype frozen projections are held in (not the batch)."""
    return repr((dims, cfg.model, cfg.lora, cfg.parallel, cfg.train.activation_checkpoint, cfg.dtype))


def simulate(cfg: PlanInputs, dims: ParallelDims) -> dict[int, dict]:
    """Rank -> what it holds, for the ranks of `_coords` (see `_simulate_rank`).

    Runs in this process on a fake process group when none exists; when one does (plan called
    inside a distributed job), in a fresh spawned process, so the real group is left alone.
    """
    import torch.distributed as dist

    key = _placement_key(cfg, dims)
    if key in _SIMULATED:
        return _SIMULATED[key]
    if dist.is_available() and dist.is_initialized():
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            placed = pool.submit(_simulate_all, cfg, dims).result()
    else:
        placed = _simulate_all(cfg, dims)
    _SIMULATED[key] = placed
    return placed


def _simulate_all(cfg: PlanInputs, dims: ParallelDims) -> dict[int, dict]:
    import sys

    hook = sys.excepthook  # init_process_group prefixes it with "[rank<R>]": put ours back
    try:
        return {rank_of(dims, c): _simulate_rank(cfg, dims, rank_of(dims, c)) for c in _coords(dims)}
    finally:
        sys.excepthook = hook


def _simulate_rank(cfg: PlanInputs, dims: ParallelDims, rank: int) -> dict:
    """{"pp": its pipeline rank, "params": {name: placement, shapes, bytes}} for `rank`: what the
    trainer's `parallelize` leaves on it (of its pipeline stages, or of the whole model), built on
    the meta device."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainbook.parallel.apply import ApplyOptions, parallelize
    from trainbook.precision import fsdp_policy, hold_frozen_projections

    # DDP (`replicate`) checks shapes with .item(), which meta tensors refuse, and leaves every
    # parameter as it is: simulate without it.
    run_dims = dataclasses.replace(dims, dp_replicate=1) if cfg.parallel.data_parallel == "ddp" else dims
    fsdp = run_dims.dp_cp > 1
    # Compiling a block wraps its forward and places nothing: left out (it costs seconds at 80 blocks).
    opts = ApplyOptions(cfg.train.activation_checkpoint, False, cfg.parallel.data_parallel, fsdp_policy(cfg.dtype))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mesh = dims.build_mesh("cpu")
            model = build_model(cfg.model, "meta", seed=0)
            apply_lora(model, cfg.lora, seed=0)  # as the trainer's surgery does: the base frozen,
            hold_frozen_projections(model, cfg.dtype)  # its projections in the compute dtype
            pp_rank = dims.coordinate(rank)["pp"]
            if dims.pp > 1:  # torch.distributed.pipelining (and dynamo) only for a pipeline
                from trainbook.parallel.pipeline import StageGroup, rank_stages

                held = StageGroup([module for _, module in rank_stages(
                    model, dims.pp, pp_rank, cfg.parallel, lambda stage: parallelize(stage, run_dims, mesh, opts))])
            else:
                held = parallelize(model, run_dims, mesh, opts)
            embeddings = {id(m.weight) for m in held.modules() if isinstance(m, nn.Embedding)}
            head = getattr(held, "output", None)
            params = {}
            for name, p in held.named_parameters():
                params[name] = _describe(p, replicated_grad=(
                    not fsdp and id(p) in embeddings and dims.tp > 1 and _sharded(p)
                    and not (head is not None and head.weight is p)
                    and not (dims.pp > 1 and cfg.model.tie_embeddings)))
    finally:
        dist.destroy_process_group()
    return {"pp": pp_rank, "params": params}


def _sharded(p) -> bool:
    return any(_placement_name(x) != "Replicate" for x in getattr(p, "placements", ()))


def _describe(p: torch.Tensor, replicated_grad: bool) -> dict:
    local = p.to_local() if hasattr(p, "to_local") else p
    mesh_dims = p.device_mesh.mesh_dim_names if hasattr(p, "device_mesh") else ()
    placements = dict(zip(mesh_dims, map(_placement_name, getattr(p, "placements", ()))))
    size = local.element_size()
    param_bytes = local.numel() * size
    grad_bytes = p.numel() * size if replicated_grad else param_bytes
    return {"shape": list(p.shape), "placements": placements, "local_shape": list(local.shape),
            "dtype": str(local.dtype).removeprefix("torch."), "param_bytes": param_bytes,
            "grad_bytes": grad_bytes if p.requires_grad else 0,
            # AdamW: exp_avg and exp_avg_sq shaped like the (local) parameter, and a step scalar.
            "optim_bytes": 2 * param_bytes + ADAM_STEP_BYTES if p.requires_grad else 0}


# ---- the plan ----------------------------------------------------------------------------------

def make_plan(cfg: PlanInputs, dims: ParallelDims, device_memory: int | None = None, recipe: str = "") -> dict:
    """The whole plan of a resolved recipe on layout `dims`, as plain data (what `--json`
    prints); `plan_text.render` turns it into text."""
    world_size = dims.world_size
    m = cfg.model
    model = build_model(m, "meta", seed=0)
    ranks = simulate(cfg, dims)
    plan = {
        "recipe": recipe, "world_size": world_size,
        "model": {"name": m.name, "family": m.family, "params": num_params(model), "n_layers": m.n_layers,
                  "dim": m.dim, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads, "head_dim": m.head_dim,
                  "qkv_bias": m.qkv_bias, "qk_norm": m.qk_norm, "ffn_dim": m.ffn_dim,
                  "vocab_size": m.vocab_size, "tie_embeddings": m.tie_embeddings, **_experts(cfg, dims)},
        "precision": {"weights": "fp32", "compute": cfg.dtype},
        "lora": _lora(cfg),
        "mesh": _mesh(dims, cfg),
        "pipeline": _pipeline(model, dims, cfg),
        "params": _params(ranks, dims),
        "batch": _batch(cfg, dims),
        "gradient_path": gradient_path(dims, cfg),
        "gradient_remedies": compression_remedies(dims, cfg),
    }
    plan["memory"] = memory(ranks, dims, cfg, plan["pipeline"], device_memory)
    worst = plan["memory"]["largest"]["rank"]
    plan["memory"]["context"] = context_table(cfg, dims, plan["pipeline"], dims.coordinate(worst)["pp"])
    return plan


def _experts(cfg: PlanInputs, dims: ParallelDims) -> dict:
    """A mixture of experts: its experts, how many each rank holds, and the parameters one token
    passes through (what MFU counts); nothing for a dense model."""
    m = cfg.model
    if m.n_experts is None:
        return {}
    return {"n_experts": m.n_experts, "experts_per_token": m.n_experts_per_token,
            "experts_per_rank": m.n_experts // dims.ep, "active_params": count(m).active}


def _lora(cfg: PlanInputs) -> dict | None:
    """What trains under `[lora]`: the adapters' parameters (the base's are frozen), or None."""
    if not cfg.lora.enabled:
        return None
    model = build_model(cfg.model, "meta", seed=0)
    apply_lora(model, cfg.lora, seed=0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "trainable_params": trainable}


def largest_fitting(cfg: PlanInputs, dims: ParallelDims, micro_batch_sizes: list[int],
                    device_memory: int) -> int | None:
    """The first of `micro_batch_sizes` (largest first) whose plan fits `device_memory` on its
    largest rank; None when none does. Placement is simulated once: it does not depend on the batch."""
    ranks = simulate(cfg, dims)
    model = build_model(cfg.model, "meta", seed=0)
    for size in micro_batch_sizes:
        c = dataclasses.replace(cfg, train=cfg.train.model_copy(update={"micro_batch_size": size}))
        if memory(ranks, dims, c, _pipeline(model, dims, c), device_memory)["fits"]:
            return size
    return None


def memory_estimates(cases: list[tuple[PlanInputs, ParallelDims]], device_memory: int | None) -> list[dict]:
    """The plan's memory (`make_plan(...)["memory"]`) of each (recipe, layout) case, placement
    simulated once per distinct layout. Inside a distributed job (the real process group must be
    left alone) all of it runs in one spawned process, as `simulate` would once per case; a
    layout placed once serves every case that shares it (`_SIMULATED`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(_memory_estimates, cases, device_memory).result()
    return _memory_estimates(cases, device_memory)


def _memory_estimates(cases: list[tuple[PlanInputs, ParallelDims]], device_memory: int | None) -> list[dict]:
    out = []
    for cfg, dims in cases:
        model = build_model(cfg.model, "meta", seed=0)
        out.append(memory(simulate(cfg, dims), dims, cfg, _pipeline(model, dims, cfg), device_memory))
    return out


def _mesh(dims: ParallelDims, cfg: PlanInputs) -> dict:
    """Degrees and groups: the ranks that differ only in one dimension communicate over it."""
    roles = {"pp": "pipeline stages (send/recv activations)",
             "dp_replicate": "DDP replicas (all-reduce gradients)" if cfg.parallel.data_parallel == "ddp"
             else "HSDP replicas (all-reduce gradient shards)",
             "dp_shard": "FSDP2 shards (all-gather params, reduce-scatter grads)",
             "cp": "context parallel: each sequence split, keys and values all-gathered per attention "
                   "(FSDP2 shards over dp_shard x cp)",
             "tp": "tensor parallel + sequence parallel"}
    groups: dict[str, list[list[int]]] = {}
    dp_groups: dict[tuple, list[int]] = {}
    for name in MESH_DIMS:
        by_rest: dict[tuple, list[int]] = {}
        for rank in range(dims.world_size):
            c = dims.coordinate(rank)
            by_rest.setdefault(tuple(v for k, v in c.items() if k != name), []).append(rank)
        groups[name] = list(by_rest.values())
    for rank in range(dims.world_size):  # ranks reading the same data: one data-parallel rank
        dp_groups.setdefault(dims.dp_rank(rank), []).append(rank)
    active = {k: roles[k] for k in MESH_DIMS if getattr(dims, k) > 1}
    groups = {k: v for k, v in groups.items() if getattr(dims, k) > 1}
    if dims.ep > 1:  # dp_shard split for the routed experts (ParallelDims.expert_mesh)
        experts = cfg.model.n_experts
        active["ep"] = (f"expert parallel: {experts // dims.ep} of {experts} routed experts per rank, tokens "
                        "sent to their experts' ranks and back (all-to-all)")
        groups["ep"] = _split_groups(dims, lambda shard: shard // dims.ep)
        if dims.efsdp * dims.dp_replicate > 1:
            active["efsdp"] = "ranks holding the same experts: FSDP2 shards them (all-gather, reduce-scatter)"
            groups["efsdp"] = _split_groups(dims, lambda shard: shard % dims.ep, replicas=True)
    return {"sizes": dims.sizes() | ({"ep": dims.ep, "efsdp": dims.efsdp} if dims.ep > 1 else {}),
            "roles": active, "groups": groups,
            "coordinates": [dims.coordinate(r) | {"dp_rank": dims.dp_rank(r)} for r in range(dims.world_size)],
            "same_data": list(dp_groups.values())}


def _split_groups(dims: ParallelDims, key, replicas: bool = False) -> list[list[int]]:
    """Ranks grouped by everything but their place in dp_shard, and `key` of that place (and, with
    `replicas`, not by dp_replicate either)."""
    by: dict[tuple, list[int]] = {}
    for rank in range(dims.world_size):
        c = dims.coordinate(rank)
        rest = (c["pp"], c["tp"], key(c["dp_shard"])) + (() if replicas else (c["dp_replicate"],))
        by.setdefault(rest, []).append(rank)
    return list(by.values())


def _pipeline(model: nn.Module, dims: ParallelDims, cfg: PlanInputs) -> dict | None:
    if dims.pp < 2:
        return None
    from trainbook.parallel.pipeline import assign_stages

    p = cfg.parallel
    block = [sum(q.numel() for q in b.parameters()) for b in model.layers.values()]
    stages = []
    for s in assign_stages(model, dims.pp, p):
        params = sum(block[j] for j in s.layers)
        params += model.tok_embeddings.weight.numel() if s.is_first else 0
        params += model.norm.weight.numel() + model.output.weight.numel() if s.is_last else 0
        stages.append({"stage": s.index, "pp_rank": s.pp_rank(dims.pp), "layers": [s.layers.start, s.layers.stop],
                       "embedding": s.is_first, "head": s.is_last, "params": params,
                       "ranks": [x for x in range(dims.world_size) if dims.coordinate(x)["pp"] == s.pp_rank(dims.pp)]})
    return {"schedule": p.pp_schedule, "stages_per_rank": p.pp_stages_per_rank,
            "microbatches": pipeline_microbatches(p, dims.pp), "split": "manual" if p.pp_split else "balanced",
            "stages": stages}


def _params(ranks: dict[int, dict], dims: ParallelDims) -> list[dict]:
    """One entry per parameter name: placement per mesh dimension, the local shape on the first
    simulated rank holding it, and the largest local shape over the simulated ranks."""
    out: dict[str, dict] = {}
    for rank in sorted(ranks):
        for name, d in ranks[rank]["params"].items():
            if name not in out:
                # Expert-parallel experts live on (efsdp, ep), the two parts of dp_shard.
                # Under context parallelism FSDP shards over dp_shard x cp, flattened (dp_shard_cp).
                split = "ep" in d["placements"]
                shard = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
                dims_of = ("dp_replicate", "efsdp", "ep", "tp") if split else ("dp_replicate", shard, "tp")
                size = {"efsdp": dims.efsdp, "ep": dims.ep, "dp_shard_cp": dims.dp_shard * dims.cp}
                placements = {k: d["placements"].get(k, "Replicate") for k in dims_of
                              if size.get(k, getattr(dims, k, 1)) > 1}
                if dims.pp > 1:
                    placements["pp"] = f"pp rank {ranks[rank]['pp']}"
                out[name] = {"name": name, "shape": d["shape"], "placements": placements, "first_rank": rank,
                             "local_shape": d["local_shape"], "largest_local_shape": d["local_shape"]}
            elif numel(d["local_shape"]) > numel(out[name]["largest_local_shape"]):
                out[name]["largest_local_shape"] = d["local_shape"]
    return list(out.values())


def _batch(cfg: PlanInputs, dims: ParallelDims) -> dict:
    t, p = cfg.train, cfg.parallel
    accum = t.grad_accum_steps(dims.dp)
    per_rank = accum * t.micro_batch_size
    out = {"seq_len": t.seq_len, "global_batch_tokens": per_rank * dims.dp * t.seq_len,
           "global_samples": per_rank * dims.dp, "data_parallel_ranks": dims.dp,
           "micro_batch_size": t.micro_batch_size, "accum_steps": accum,
           "samples_per_rank": per_rank, "tokens_per_rank": per_rank * t.seq_len,
           **({"cp": dims.cp} if dims.cp > 1 else {})}
    if dims.pp > 1:
        n = pipeline_microbatches(p, dims.pp)
        out |= {"pp_microbatches": n, "pp_microbatch_samples": t.micro_batch_size // n}
    return out
