"""`trainbook plan`: who holds what, how data and gradients flow, and memory per rank, for a layout.

No training process is started. Parameter placement is not re-derived by hand: the real
`parallelize` (and the pipeline's stage cutting) runs on a model built on the meta device, once per
rank coordinate, inside this process on PyTorch's *fake* process group (collectives that do
nothing), and the resulting DTensors are read: placements per mesh dimension, global and local
shapes. So FSDP2's padded dim-0 chunks, TP's column/row shards and their strided composition are
exactly what the trainer's ranks will hold. Parameters, gradients and optimizer states are exact
bytes (tests/dist/test_plan.py compares them with real gloo ranks); activations are an estimate
from a per-block formula of this Llama (compared with saved-tensor hooks in the same test).

Gradient layouts equal parameter layouts, with one exception torch 2.13 has: a tensor-parallel
(Shard(0)) embedding without FSDP gets a Replicate gradient (the full table on every tp rank),
unless the same tensor is the output head's (tied, pp = 1) or the pipeline's tied-gradient
exchange redistributes it (tied, pp > 1).
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import torch
from torch import nn

from trainbook.config import Config
from trainbook.errors import TrainbookError
from trainbook.model import build_model, num_params
from trainbook.parallel.dims import MESH_DIMS, ParallelDims, resolve_dims

WHERE_MEMORY = "--device-memory"
ADAM_STEP_BYTES = 4  # AdamW's per-parameter `step`: a float32 scalar tensor
MAX_SIMULATED = 64  # distinct rank coordinates simulated one by one; beyond, a sample (see _coords)


# ---- sizes ------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: str, where: str = WHERE_MEMORY) -> int:
    """'80GiB', '512MiB', '80G' (binary), '1.5TB', '80GB' (decimal), '1000' (bytes) -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise TrainbookError(f"{text!r} is not a memory size (e.g. 80GiB, 512MiB, 1.5TB)", where=where)
    return int(float(match.group(1)) * _UNITS[unit])


def human(n: float) -> str:
    """Bytes with three significant digits at most: 4 B, 768 KiB, 1.69 MiB, 29.9 GiB."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            v = n / size
            text = f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f}"
            return (text.rstrip("0").rstrip(".") if "." in text else text) + f" {unit}"
    return f"{int(n)} B"


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
    are copies), so its index is 0. All (pp, dp_shard, tp) when few; else each pipeline rank at
    the first and last dp_shard/tp index (the first holds the largest chunks, torch.chunk-style)."""
    sizes = dims.sizes()
    if sizes["pp"] * sizes["dp_shard"] * sizes["tp"] <= MAX_SIMULATED:
        shard, tp = range(sizes["dp_shard"]), range(sizes["tp"])
    else:
        shard, tp = sorted({0, sizes["dp_shard"] - 1}), sorted({0, sizes["tp"] - 1})
    return [{"pp": p, "dp_replicate": 0, "dp_shard": s, "tp": t}
            for p in range(sizes["pp"]) for s in shard for t in tp]


def _rank_of(dims: ParallelDims, coord: dict[str, int]) -> int:
    rank = 0
    for name in MESH_DIMS:
        rank = rank * getattr(dims, name) + coord[name]
    return rank


def simulate(cfg: Config, dims: ParallelDims) -> dict[int, dict]:
    """Rank -> what it holds, for the ranks of `_coords` (see `_simulate_rank`).

    Runs in this process on a fake process group when none exists; when one does (plan called
    inside a distributed job), in a fresh spawned process, so the real group is left alone.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(_simulate_all, cfg, dims).result()
    return _simulate_all(cfg, dims)


def _simulate_all(cfg: Config, dims: ParallelDims) -> dict[int, dict]:
    import sys

    hook = sys.excepthook  # init_process_group prefixes it with "[rank<R>]": put ours back
    try:
        return {_rank_of(dims, c): _simulate_rank(cfg, dims, _rank_of(dims, c)) for c in _coords(dims)}
    finally:
        sys.excepthook = hook


def _simulate_rank(cfg: Config, dims: ParallelDims, rank: int) -> dict:
    """{"pp": its pipeline rank, "params": {name: placement, shapes, bytes}} for `rank`: what the
    trainer's `parallelize` leaves on it (of its pipeline stages, or of the whole model), built on
    the meta device."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainbook.parallel.apply import parallelize
    from trainbook.parallel.pipeline import StageGroup, cut_stage, model_stage_layers

    # DDP (`replicate`) checks shapes with .item(), which meta tensors refuse, and leaves every
    # parameter as it is: simulate without it.
    run_dims = dataclasses.replace(dims, dp_replicate=1) if cfg.parallel.data_parallel == "ddp" else dims
    fsdp = run_dims.dp > 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mesh = dims.build_mesh("cpu")
            model = build_model(cfg.model, "meta", seed=cfg.run.seed)
            pp_rank = dims.coordinate(rank)["pp"]
            if dims.pp > 1:
                n_stages = dims.pp * cfg.parallel.pp_stages_per_rank
                layers = model_stage_layers(model, n_stages, cfg.parallel.pp_split)
                mine = list(range(pp_rank, n_stages, dims.pp))
                modules = [parallelize(cut_stage(model, layers[i], i == 0, i == n_stages - 1), run_dims, mesh, cfg)
                           for i in mine]
                held = StageGroup(modules)
            else:
                held = parallelize(model, run_dims, mesh, cfg)
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

def make_plan(cfg: Config, world_size: int, device_memory: int | None = None, recipe: str = "") -> dict:
    """The whole plan as plain data (what `--json` prints); `plan_text.render` turns it into text."""
    dims = resolve_dims(cfg, world_size, where=recipe or "recipe")
    m = cfg.model
    model = build_model(m, "meta", seed=0)
    ranks = simulate(cfg, dims)
    plan = {
        "recipe": recipe, "world_size": world_size,
        "model": {"name": m.name, "params": num_params(model), "n_layers": m.n_layers, "dim": m.dim,
                  "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads, "ffn_dim": m.ffn_dim,
                  "vocab_size": m.vocab_size, "tie_embeddings": m.tie_embeddings},
        "precision": {"weights": "fp32", "compute": cfg.precision.dtype},
        "mesh": _mesh(dims, cfg),
        "pipeline": _pipeline(model, dims, cfg),
        "params": _params(ranks, dims),
        "batch": _batch(cfg, dims),
        "gradient_path": _gradient_path(dims, cfg),
    }
    plan["memory"] = _memory(ranks, dims, cfg, plan["pipeline"], device_memory)
    return plan


def _mesh(dims: ParallelDims, cfg: Config) -> dict:
    """Degrees and groups: the ranks that differ only in one dimension communicate over it."""
    roles = {"pp": "pipeline stages (send/recv activations)",
             "dp_replicate": "DDP replicas (all-reduce gradients)" if cfg.parallel.data_parallel == "ddp"
             else "HSDP replicas (all-reduce gradient shards)",
             "dp_shard": "FSDP2 shards (all-gather params, reduce-scatter grads)",
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
    return {"sizes": dims.sizes(), "roles": {k: roles[k] for k in MESH_DIMS if getattr(dims, k) > 1},
            "groups": {k: v for k, v in groups.items() if getattr(dims, k) > 1},
            "coordinates": [dims.coordinate(r) | {"dp_rank": dims.dp_rank(r)} for r in range(dims.world_size)],
            "same_data": list(dp_groups.values())}


def _pipeline(model: nn.Module, dims: ParallelDims, cfg: Config) -> dict | None:
    if dims.pp < 2:
        return None
    from trainbook.parallel.pipeline import model_stage_layers

    p = cfg.parallel
    n_stages = dims.pp * p.pp_stages_per_rank
    layers = model_stage_layers(model, n_stages, p.pp_split)
    block = [sum(q.numel() for q in b.parameters()) for b in model.layers.values()]
    stages = []
    for i, r in enumerate(layers):
        params = sum(block[j] for j in r)
        params += model.tok_embeddings.weight.numel() if i == 0 else 0
        params += model.norm.weight.numel() + model.output.weight.numel() if i == n_stages - 1 else 0
        stages.append({"stage": i, "pp_rank": i % dims.pp, "layers": [r.start, r.stop],
                       "embedding": i == 0, "head": i == n_stages - 1, "params": params,
                       "ranks": [x for x in range(dims.world_size) if dims.coordinate(x)["pp"] == i % dims.pp]})
    return {"schedule": p.pp_schedule, "stages_per_rank": p.pp_stages_per_rank,
            "microbatches": p.pp_microbatches or n_stages, "split": "manual" if p.pp_split else "balanced",
            "stages": stages}


def _params(ranks: dict[int, dict], dims: ParallelDims) -> list[dict]:
    """One entry per parameter name: placement per mesh dimension, the local shape on the first
    simulated rank holding it, and the largest local shape over the simulated ranks."""
    out: dict[str, dict] = {}
    for rank in sorted(ranks):
        for name, d in ranks[rank]["params"].items():
            if name not in out:
                placements = {k: d["placements"].get(k, "Replicate") for k in ("dp_replicate", "dp_shard", "tp")
                              if getattr(dims, k) > 1}
                if dims.pp > 1:
                    placements["pp"] = f"pp rank {ranks[rank]['pp']}"
                out[name] = {"name": name, "shape": d["shape"], "placements": placements, "first_rank": rank,
                             "local_shape": d["local_shape"], "largest_local_shape": d["local_shape"]}
            elif _numel(d["local_shape"]) > _numel(out[name]["largest_local_shape"]):
                out[name]["largest_local_shape"] = d["local_shape"]
    return list(out.values())


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _batch(cfg: Config, dims: ParallelDims) -> dict:
    t, p = cfg.train, cfg.parallel
    accum = t.grad_accum_steps(dims.dp)
    per_rank = accum * t.micro_batch_size
    out = {"seq_len": t.seq_len, "global_batch_tokens": per_rank * dims.dp * t.seq_len,
           "global_samples": per_rank * dims.dp, "data_parallel_ranks": dims.dp,
           "micro_batch_size": t.micro_batch_size, "accum_steps": accum,
           "samples_per_rank": per_rank, "tokens_per_rank": per_rank * t.seq_len}
    if dims.pp > 1:
        n = p.pp_microbatches or dims.pp * p.pp_stages_per_rank
        out |= {"pp_microbatches": n, "pp_microbatch_samples": t.micro_batch_size // n}
    return out


# ---- communication -----------------------------------------------------------------------------

def _compute_bytes(cfg: Config) -> int:
    return 4 if cfg.precision.dtype == "fp32" else 2  # bf16 (or fp16)


def _block_numel(cfg: Config, tp: int) -> tuple[int, int]:
    """(matrix elements per block on one tp rank, norm-gain elements per block)."""
    m = cfg.model
    kv = m.n_kv_heads * (m.dim // m.n_heads)
    return (2 * m.dim * m.dim + 2 * m.dim * kv + 3 * m.dim * m.ffn_dim) // tp, 2 * m.dim


def _gradient_path(dims: ParallelDims, cfg: Config) -> list[dict]:
    """Every collective of one optimizer step, by mesh dimension: what, how big, how often."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    c = _compute_bytes(cfg)
    accum = t.grad_accum_steps(dims.dp)
    matrices, gains = _block_numel(cfg, dims.tp)
    block = matrices + gains
    root = (1 if m.tie_embeddings and dims.pp == 1 else 2) * m.vocab_size * m.dim // dims.tp + m.dim
    n_mb = (p.pp_microbatches or dims.pp * p.pp_stages_per_rank) if dims.pp > 1 else 1
    tokens = t.micro_batch_size // n_mb * t.seq_len  # (B, T) of one micro-batch (pipeline chunk)
    r = _residual_bytes(cfg, dims)
    path = []
    if dims.dp > 1 and p.data_parallel == "fsdp":
        pd = c  # FSDP's MixedPrecisionPolicy gathers parameters in the compute dtype
        path.append({"dim": "dp_shard", "op": "all-gather", "bytes": block * pd, "per": "block",
                     "text": f"all-gather each block's parameters before its forward and again before its "
                             f"backward ({human(block * pd)} per block in {_dtype(pd, cfg)}; the root's embedding, "
                             f"norm and head, {human(root * pd)}, once per pass and kept; the last block "
                             f"stays gathered for backward)"})
        path.append({"dim": "dp_shard", "op": "reduce-scatter", "bytes": block * 4, "per": "block",
                     "text": f"reduce-scatter each block's gradient after its backward ({human(block * 4)} per "
                             f"block in fp32): every pass, {accum} pass(es) per step"})
        if dims.dp_replicate > 1:
            shard = (m.n_layers * block + root) * 4 // dims.dp_shard // dims.pp
            path.append({"dim": "dp_replicate", "op": "all-reduce", "bytes": shard, "per": "pass",
                         "text": f"all-reduce the reduce-scattered gradient shards across the {dims.dp_replicate} "
                                 f"replicas (HSDP; ~{human(shard)} per rank per pass)"})
    elif dims.dp > 1:
        grads = (m.n_layers * block + root) * 4 // dims.pp
        path.append({"dim": "dp_replicate", "op": "all-reduce", "bytes": grads, "per": "pass",
                     "text": f"all-reduce every gradient (DDP, 25 MiB buckets overlapped with backward; "
                             f"~{human(grads)} per rank per pass)"})
    if dims.tp > 1:
        gather, scatter = tokens * m.dim * r, tokens * m.dim * c
        logits = tokens * m.vocab_size * c
        recompute = " (and again in the recomputed forward)" if t.activation_checkpoint != "none" else ""
        path.append({"dim": "tp", "op": "all-gather + reduce-scatter", "bytes": gather + scatter, "per": "block",
                     "text": f"sequence parallel, per block and micro-batch: forward all-gathers the normed "
                             f"residual twice (attention, feed-forward: {human(gather)} each, {_dtype(r, cfg)}) and "
                             f"reduce-scatters the wo / w2 outputs twice ({human(scatter)} each, {_dtype(c, cfg)})"
                             f"{recompute}; "
                             "backward the mirror image"})
        path.append({"dim": "tp", "op": "all-gather", "bytes": logits, "per": "micro-batch",
                     "text": f"embedding output reduce-scattered to sequence shards; the head all-gathers the "
                             f"sequence and then the logits ({human(logits)}: every tp rank gets all of them)"})
        path.append({"dim": "tp", "op": "all-reduce", "bytes": (m.n_layers * gains + m.dim) * 4, "per": "step",
                     "text": "norm-gain gradients are partial sums (Partial) on each tp rank: all-reduced when "
                             "clipping and the optimizer read them"})
    if dims.pp > 1:
        act = tokens // dims.tp * m.dim * r
        path.append({"dim": "pp", "op": "send/recv", "bytes": act, "per": "micro-batch",
                     "text": f"each pipeline micro-batch's hidden states (B {t.micro_batch_size // n_mb}, "
                             f"T {t.seq_len // dims.tp}, dim {m.dim}) {_dtype(r, cfg)} = {human(act)} sent to the next "
                             f"stage in forward, their gradient sent back in backward: {n_mb} x {accum} per step at "
                             f"each of {dims.pp * p.pp_stages_per_rank - 1} stage boundaries"})
        if m.tie_embeddings:
            path.append({"dim": "pp", "op": "send/recv", "bytes": m.vocab_size * m.dim * 4 // dims.tp, "per": "step",
                         "text": "tied embedding: the first and last stage exchange the embedding / head "
                                 "gradient shards once per step and both add them"})
    return path


def _dtype(n: int, cfg: Config) -> str:
    return "fp32" if n == 4 else cfg.precision.dtype


# ---- memory ------------------------------------------------------------------------------------

def _residual_bytes(cfg: Config, dims: ParallelDims) -> int:
    """The residual stream's element size: fp32, except when FSDP's mixed-precision policy hands
    the model bf16 weights (the embedding then returns bf16); autocast alone keeps it fp32."""
    fsdp = dims.dp > 1 and cfg.parallel.data_parallel == "fsdp"
    return 2 if fsdp and cfg.precision.dtype != "fp32" else 4


def activation_terms(cfg: Config, samples: int, tp: int, r: int = 4) -> dict[str, int]:
    """Bytes saved for backward by one micro-batch of `samples` sequences, per part (this Llama).

    Per block, S = samples x seq_len tokens, D dim, Dkv kv dim, F ffn_dim, H heads, c compute bytes
    (4 fp32, 2 bf16), r the residual stream's bytes (`_residual_bytes`); sequence parallel divides
    the residual stream by tp, tensor parallel the heads and hidden units:
      each of the two norms, sequence-sharded (/ tp): its input in fp32 (the residual itself, or
        an fp32 copy when r = 2), 1/rms, normalised x in r bytes     2 (4 S D + 4 S + r S D)
      projection inputs, gathered: the norms' outputs, 2 S D c; but autocast over fp32 weights
        casts a bf16 copy per projection (wq, wk, wv; w1, w3)          5 S D 2
      attention (/ tp): rotated q, k, v; output; logsumexp (fp32)      (2 D + 2 Dkv) S c + 4 S H
      SwiGLU (/ tp): w1 out, w3 out, silu(w1 out), their product       4 S F c
    `full` checkpointing keeps each block's input only (S D r / tp); `selective` keeps the input
    and the outputs of the matmuls and attention (q, k, v, attention out + logsumexp, w1, w3 / tp;
    wo and w2 whole, before their reduce-scatter). Outside the blocks: the token ids (first
    stage); on the last stage the final norm, its gathered output, the fp32 log-probabilities of
    the loss (S x vocab) and the targets. tests/dist/test_plan.py holds this against saved-tensor
    hooks on real ranks (fp32 and bf16, FSDP and TP, with and without checkpointing).
    """
    m, T = cfg.model, cfg.train.seq_len
    c = _compute_bytes(cfg)
    S, D, F, H = samples * T, m.dim, m.ffn_dim, m.n_heads
    kv = m.n_kv_heads * (m.dim // m.n_heads)
    norm = (4 * S * D + 4 * S + r * S * D) // tp  # one norm, sequence-sharded
    inputs = 5 * S * D * 2 if c == 2 and r == 4 else 2 * S * D * c
    # FSDP's mixed-precision policy casts every floating block input to bf16, the RoPE tables
    # (max_seq_len x head_dim / 2, cos and sin) included: each block keeps its own copy.
    rope = 2 * m.max_seq_len * (D // H // 2) * 2 if r == 2 else 0
    none = rope + 2 * norm + inputs + ((2 * D + 2 * kv + 4 * F) * S * c + 4 * S * H) // tp
    full = rope + S * D * r // tp
    selective = full + ((2 * D + 2 * kv + 2 * F) * S * c + 4 * S * H) // tp + 2 * S * D * c
    return {
        "block_none": none, "block_full": full, "block_selective": selective,
        "embedding": 8 * S,  # the token ids (int64)
        # final norm, its gathered output, log-probabilities, targets, the loss's weight total
        "head": norm + S * D * c + S * m.vocab_size * 4 + 8 * S + 4,
        "stage_output": S * D * r // tp,  # kept by a pipeline stage until its backward
        # The logits (whole vocabulary on every tp rank) and their gradient, around the loss.
        "logits_transient": S * m.vocab_size * (4 + (c if c != 4 else 0)),
    }


def weight_casts(cfg: Config, dims: ParallelDims, held: dict) -> dict[str, int]:
    """Bytes of the bf16 weight copies autocast makes (cached for the forward, saved for backward)
    per checkpointing mode: every projection and head weight this rank holds, or with
    checkpointing only the head's (inside a checkpointed block they are dropped after forward).
    None in fp32, and none under FSDP, which gathers the weights in bf16 itself."""
    if cfg.precision.dtype == "fp32" or (dims.dp > 1 and cfg.parallel.data_parallel == "fsdp"):
        return {"none": 0, "full": 0, "selective": 0}
    head_name = "tok_embeddings.weight" if cfg.model.tie_embeddings and dims.pp == 1 else "output.weight"
    blocks = sum(d["param_bytes"] for n, d in held["params"].items()
                 if n.startswith("layers.") and len(d["shape"]) == 2) // 2
    head = held["params"][head_name]["param_bytes"] // 2 if head_name in held["params"] else 0
    return {"none": blocks + head, "full": head, "selective": head}


def activations(cfg: Config, dims: ParallelDims, pipeline: dict | None, pp_rank: int,
                casts: dict[str, int] | None = None) -> dict[str, dict]:
    """Per checkpointing mode: `kept` (saved for backward once every in-flight micro-batch has run
    its forward, plus autocast's weight copies `casts`) and `peak` (kept + one block's recompute +
    the logits around the loss)."""
    t, p = cfg.train, cfg.parallel
    casts = casts or {}
    if pipeline is None:
        stages = [(cfg.model.n_layers, True, True)]
        samples, in_flight, per_rank = t.micro_batch_size, 1, 1
    else:
        stages = [(s["layers"][1] - s["layers"][0], s["embedding"], s["head"])
                  for s in pipeline["stages"] if s["pp_rank"] == pp_rank]
        n_mb, per_rank = pipeline["microbatches"], p.pp_stages_per_rank
        samples = t.micro_batch_size // n_mb
        if p.pp_schedule == "gpipe":  # every forward before any backward
            in_flight = n_mb
        elif p.pp_schedule == "1f1b":  # warm-up forwards + one: the first stage holds pp of them
            in_flight = min(n_mb, dims.pp - pp_rank)
        else:  # interleaved: torch's warm-up count of stage-chunks, + one
            in_flight = min(n_mb * per_rank, (per_rank - 1) * dims.pp + 2 * (dims.pp - 1 - pp_rank) + 1)
    a = activation_terms(cfg, samples, dims.tp, _residual_bytes(cfg, dims))
    has_last = any(last for _, _, last in stages)
    out = {}
    for mode in ("none", "full", "selective"):
        one = sum(n * a[f"block_{mode}"] + first * a["embedding"]
                  + (a["head"] if last else a["stage_output"]) for n, first, last in stages)
        kept = one * in_flight // per_rank + casts.get(mode, 0)  # interleaved: in-flight stage-chunks
        peak = kept + a["block_none"] - a[f"block_{mode}"] + (a["logits_transient"] if has_last else 0)
        out[mode] = {"kept": kept, "peak": peak}
    out["in_flight_microbatches"] = in_flight
    out["microbatch_samples"] = samples
    return out


def _transient(cfg: Config, dims: ParallelDims, held: dict, grads: int) -> int:
    """Communication buffers, estimated: FSDP's gathered parameters (the root's for the whole
    pass, the current, prefetched and kept-last block, one block's unsharded fp32 gradient
    before its reduce-scatter), or DDP's gradient buckets (a second copy of the gradients)."""
    if dims.dp == 1:
        return 0
    if cfg.parallel.data_parallel == "ddp":
        return grads
    pd = _compute_bytes(cfg)
    matrices, gains = _block_numel(cfg, dims.tp)
    names = held["params"]
    root = sum(_numel(d["shape"]) // (dims.tp if "tp" in d["placements"] and d["placements"]["tp"] != "Replicate"
                                      else 1)
               for n, d in names.items() if not n.startswith("layers."))
    blocks = min(3, sum(1 for n in names if n.endswith("attention_norm.weight")))
    return root * pd + (matrices + gains) * (blocks * pd + 4)


def _memory(ranks: dict[int, dict], dims: ParallelDims, cfg: Config, pipeline: dict | None,
            limit: int | None) -> dict:
    mode = cfg.train.activation_checkpoint
    rows: dict[int, dict] = {}
    for rank, held in ranks.items():
        params = sum(d["param_bytes"] for d in held["params"].values())
        grads = sum(d["grad_bytes"] for d in held["params"].values())
        optim = sum(d["optim_bytes"] for d in held["params"].values())
        act = activations(cfg, dims, pipeline, held["pp"], weight_casts(cfg, dims, held))
        transient = _transient(cfg, dims, held, grads)
        total = params + grads + optim + act[mode]["peak"] + transient
        rows[rank] = {"params": params, "grads": grads, "optimizer": optim, "activations": act,
                      "transient": transient, "total": total}
    per_rank = []
    for rank in range(dims.world_size):  # replicas hold what their dp_replicate-0 twin holds
        twin = _rank_of(dims, dims.coordinate(rank) | {"dp_replicate": 0})
        if twin in rows:
            per_rank.append({"rank": rank, **rows[twin]})
    worst = max(per_rank, key=lambda r: r["total"])
    out = {"activation_checkpoint": mode, "per_rank": per_rank, "world_size": dims.world_size,
           "ranks_covered": len(per_rank),
           "largest": {"rank": worst["rank"], "total": worst["total"]}, "device_memory": limit, "fits": None}
    if limit is not None:
        out["fits"] = worst["total"] <= limit
        out["verdict"] = _verdict(worst, limit, mode)
    return out


def _verdict(worst: dict, limit: int, mode: str) -> str:
    need, rank = worst["total"], worst["rank"]
    if need <= limit:
        return f"FITS: the largest rank ({rank}) needs ~{human(need)} of {human(limit)} ({100 * need / limit:.0f}%)"
    hints = []
    for other in ("selective", "full"):  # the one that recomputes less first
        alt = need - worst["activations"][mode]["peak"] + worst["activations"][other]["peak"]
        if other != mode and alt <= limit:
            hints.append(f"train.activation_checkpoint = {other} would fit ({human(alt)})")
            break
    states = worst["params"] + worst["grads"] + worst["optimizer"]
    if states > limit:
        hints.append(f"parameters, gradients and optimizer states alone take {human(states)}: shard them over "
                     "more ranks (dp_shard, tp, pp)")
    hints = hints or ["shard further (dp_shard, tp, pp), checkpoint activations or cut train.micro_batch_size"]
    return (f"DOES NOT FIT: rank {rank} needs ~{human(need)} but the device has {human(limit)}; "
            + "; ".join(hints))
