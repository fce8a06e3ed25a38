"""`trainbook plan`'s memory arithmetic: bytes per rank for parameters, gradients, optimizer
states, activations (a per-block formula of this Llama, held against saved-tensor hooks in
tests/dist/test_plan.py) and communication buffers, and the verdict against a device's memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainbook.parallel.dims import MESH_DIMS, ParallelDims
from trainbook.sizes import human

if TYPE_CHECKING:
    from trainbook.parallel.plan import PlanInputs

__all__ = ["activation_terms", "activations", "human", "weight_casts"]


def _rank_of(dims: ParallelDims, coord: dict[str, int]) -> int:
    rank = 0
    for name in MESH_DIMS:
        rank = rank * getattr(dims, name) + coord[name]
    return rank


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _compute_bytes(cfg: PlanInputs) -> int:
    return 4 if cfg.dtype == "fp32" else 2  # bf16 (or fp16)


def _block_numel(cfg: PlanInputs, tp: int) -> tuple[int, int]:
    """(matrix elements per block on one tp rank, norm-gain elements per block)."""
    m = cfg.model
    kv = m.n_kv_heads * (m.dim // m.n_heads)
    return (2 * m.dim * m.dim + 2 * m.dim * kv + 3 * m.dim * m.ffn_dim) // tp, 2 * m.dim


# ---- memory ------------------------------------------------------------------------------------

def _residual_bytes(cfg: PlanInputs, dims: ParallelDims) -> int:
    """The residual stream's element size: fp32, except when FSDP's mixed-precision policy hands
    the model bf16 weights (the embedding then returns bf16); autocast alone keeps it fp32."""
    fsdp = dims.dp > 1 and cfg.parallel.data_parallel == "fsdp"
    return 2 if fsdp and cfg.dtype != "fp32" else 4


def activation_terms(cfg: PlanInputs, samples: int, tp: int, r: int = 4) -> dict[str, int]:
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


def weight_casts(cfg: PlanInputs, dims: ParallelDims, held: dict) -> dict[str, int]:
    """Bytes of the bf16 weight copies autocast makes (cached for the forward, saved for backward)
    per checkpointing mode: every projection and head weight this rank holds, or with
    checkpointing only the head's (inside a checkpointed block they are dropped after forward).
    None in fp32, and none under FSDP, which gathers the weights in bf16 itself."""
    if cfg.dtype == "fp32" or (dims.dp > 1 and cfg.parallel.data_parallel == "fsdp"):
        return {"none": 0, "full": 0, "selective": 0}
    head_name = "tok_embeddings.weight" if cfg.model.tie_embeddings and dims.pp == 1 else "output.weight"
    blocks = sum(d["param_bytes"] for n, d in held["params"].items()
                 if n.startswith("layers.") and len(d["shape"]) == 2) // 2
    head = held["params"][head_name]["param_bytes"] // 2 if head_name in held["params"] else 0
    return {"none": blocks + head, "full": head, "selective": head}


def activations(cfg: PlanInputs, dims: ParallelDims, pipeline: dict | None, pp_rank: int,
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


def _transient(cfg: PlanInputs, dims: ParallelDims, held: dict, grads: int) -> int:
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


def _memory(ranks: dict[int, dict], dims: ParallelDims, cfg: PlanInputs, pipeline: dict | None,
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
