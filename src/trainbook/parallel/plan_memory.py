"""`trainbook plan`'s memory arithmetic: bytes per rank for parameters, gradients, optimizer
states, activations (a per-block formula of the decoder, held against saved-tensor hooks in
tests/dist/test_plan.py) and communication buffers, and the verdict against a device's memory.
`PlanInputs`, what a plan reads of a resolved recipe, lives here: the arithmetic reads it, and
plan.py builds on this module."""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from itertools import accumulate

from trainbook.config import LoraConfig, ModelConfig, ParallelConfig, TrainConfig
from trainbook.model.count import count
from trainbook.model.moe import is_moe_layer
from trainbook.model.registry import resolve as resolve_model
from trainbook.parallel.dims import MESH_DIMS, ParallelDims
from trainbook.sizes import human

__all__ = [
    "PlanInputs", "activation_terms", "activations", "block_numel", "compute_bytes", "context_table", "human",
    "kv_cache_bytes",
    "routed_numel",
    "memory", "numel", "rank_of", "reference_bytes", "residual_bytes", "schedule_actions", "weight_casts",
]


@dataclass(frozen=True)
class PlanInputs:
    """What a plan reads of a resolved recipe: the model, the batch, the layout, the compute dtype."""

    model: ModelConfig
    train: TrainConfig
    parallel: ParallelConfig
    dtype: str
    """Compute dtype (precision.dtype): fp32, bf16 or fp16."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """`[lora]`: with a rank, the base is frozen (its weights held, no gradients, no optimizer
    state) and only the adapters train."""
    rows_per_sample: int = 1
    """Sequences one sample of `micro_batch_size` is: a DPO pair is 2."""
    reference: bool = False
    """A frozen whole copy of the starting model is kept on every rank (GRPO with kl_coef > 0,
    DPO's `frozen` reference), in fp32 as the model is built."""
    rollout: tuple[int, int] | None = None
    """GRPO: (completions this rank samples at once, positions of a row: prompt + max_new_tokens,
    at most seq_len): the KV cache of the rollout batch, alive while sampling, not in backward."""


def rank_of(dims: ParallelDims, coord: dict[str, int]) -> int:
    """The global rank at mesh coordinate `coord` (row-major over MESH_DIMS, as dims.py lays it out)."""
    rank = 0
    for name in MESH_DIMS:
        rank = rank * getattr(dims, name) + coord[name]
    return rank


def numel(shape: list[int]) -> int:
    """The number of elements of a tensor of `shape`."""
    n = 1
    for s in shape:
        n *= s
    return n


def compute_bytes(cfg: PlanInputs) -> int:
    """The element size of the compute dtype: what activations and gathered weights take."""
    return 4 if cfg.dtype == "fp32" else 2  # bf16 (or fp16)


def block_numel(cfg: PlanInputs, tp: int, ep: int = 1) -> tuple[int, int]:
    """(elements per block tp splits, on one tp rank: projections and their biases; elements every
    rank holds whole: norm gains, q/k norms), from the model's one count (`model/count.py`). With
    expert parallelism a rank gathers only its n_experts / ep routed experts."""
    c = count(cfg.model)
    return (c.block_sharded - routed_numel(cfg) * (ep - 1) // ep) // tp, c.block_replicated


def routed_numel(cfg: PlanInputs) -> int:
    """The routed experts' elements in one MoE block (0 for a dense model)."""
    m = cfg.model
    return 3 * m.n_experts * m.expert_ffn_dim * m.dim if m.n_experts else 0


# ---- memory ------------------------------------------------------------------------------------

def residual_bytes(cfg: PlanInputs, dims: ParallelDims) -> int:
    """The residual stream's element size: fp32, except when FSDP's mixed-precision policy hands
    the model bf16 weights (the embedding then returns bf16); autocast alone keeps it fp32."""
    fsdp = dims.dp_cp > 1 and cfg.parallel.data_parallel == "fsdp"
    return 2 if fsdp and cfg.dtype != "fp32" else 4


def activation_terms(cfg: PlanInputs, samples: int, tp: int, r: int = 4, cp: int = 1) -> dict[str, int]:
    """Bytes saved for backward by one micro-batch of `samples` sequences, per part (the decoder
    with its family's options; q/k/v biases add nothing: a projection's output is saved or not
    whatever its bias).

    Per block, S = samples x seq_len tokens, D dim, Q = H x head_dim the query width and K =
    Hkv x head_dim the key (and value) width (not D and D Hkv / H: Qwen3's head_dim is its own),
    F ffn_dim, H heads, Hkv kv heads, c compute bytes (4 fp32, 2 bf16), r the residual stream's
    bytes (`residual_bytes`); sequence parallel divides the residual stream by tp, tensor
    parallel the heads and hidden units:
      each of the two norms, sequence-sharded (/ tp): its input in fp32 (the residual itself, or
        an fp32 copy when r = 2), 1/rms, normalised x in r bytes     2 (4 S D + 4 S + r S D)
      projection inputs, gathered: the norms' outputs, 2 S D c; but autocast over fp32 weights
        casts a bf16 copy per projection (wq, wk, wv; w1, w3)          5 S D 2
      attention (/ tp): rotated q, k, v; output; logsumexp (fp32)      (2 Q + 2 K) S c + 4 S H
      q/k norms (qk_norm, / tp: on the heads), over wq / wk outputs
        in c bytes: the fp32 input, 1/rms per head, normalised         (4 + c)(Q + K) S + 4 S (H + Hkv)
      SwiGLU (/ tp): w1 out, w3 out, silu(w1 out), their product       4 S F c
    Multi-head latent attention (`model/mla.py`; tensor parallel is refused for it), with latents
    Lq (0: none) and Lkv, n + p query/key channels a head (p rotated), v value channels, in place of
    the attention and q/k norms above (two projections read the norm's output, not three):
      each latent's norm: its fp32 input, 1/rms, normed, output       4 S L + 4 S + 2 S L c
      RoPE's fp32 inputs: the queries' rotated channels, the shared
        key's (in fp32 the key's also stay inside wkv_a's output)     4 S H p + 4 S p (+ 4 S p)
      attention: q, k, the values padded to n + p, output; logsumexp  4 S H (n + p) c + 4 S H
    and under `selective` the outputs of wq_a (or wq), wq_b, wkv_a, wkv_b and attention.
    `full` checkpointing keeps each block's input only (S D r / tp); `selective` keeps the input
    and the outputs of the matmuls and attention (q, k, v, attention out + logsumexp, w1, w3 / tp;
    wo and w2 whole, before their reduce-scatter) and recomputes the q/k norms. The RoPE tables
    are the model's fp32 buffers, passed to every block as they are (FSDP does not cast block
    inputs: `apply_fsdp`): nothing per block. Outside the blocks: the token ids (first stage); on
    the last stage the final norm, its gathered output, the fp32 log-probabilities of the loss
    (S x vocab) and the targets. A pipeline stage also holds its output until the micro-batch's
    backward: the residual stream, or on the last stage the logits (S x vocab, compute dtype).
    A mixture of experts' layer (`moe_block_*`; tensor parallel is refused for it), with E experts,
    k a token, expert hidden size Fe and shared hidden size Fs, keeps in place of the SwiGLU:
      the router, in fp32: its input (the norm's output, an fp32 copy under autocast: so the
        projection inputs are 3 S D 2 + S D 4 in bf16), the scores, the chosen experts and their
        weights (and the renormalising sum)                             S E 4 + S k 12 (+ 4 S)
      dispatch: the sorted (token, expert) rows, the sort and its inverse  S k D c + 16 S k
      the experts' SwiGLU over S k rows                                  4 S k Fe c
      the combine, fp32: each choice's output                            4 S k D
      shared experts: a SwiGLU of Fs (its input cast twice under autocast)  4 S Fs c (+ 2 S D 2)
    and under `selective` the router's logits (S E 4), the shared experts' matmul outputs
    (2 S Fs c + S D c) and wo's: the experts' grouped matmuls are recomputed.
    Under context parallelism (cp) S is this rank's share of the tokens, samples x seq_len / cp,
    and the attention keeps every cp rank's keys and values, gathered (2 K S cp c in place of
    2 K S c), beside the mask of its queries over every key (S x seq_len bytes, one for all blocks)
    and the positions.
    tests/dist/test_plan.py holds this against saved-tensor hooks on real ranks (fp32 and bf16,
    FSDP, TP and every pipeline schedule, with and without checkpointing; a Qwen3-shaped model:
    q/k norms, Q != D, GQA, under TP in fp32 and bf16; in one process a tiny MoE with and without
    a shared expert).
    """
    m, T = cfg.model, cfg.train.seq_len // cp
    c = compute_bytes(cfg)
    S, D, F, H = samples * T, m.dim, m.ffn_dim, m.n_heads
    cast = c == 2 and r == 4  # autocast over fp32 weights: a bf16 copy of the input per projection
    norm = (4 * S * D + 4 * S + r * S * D) // tp  # one norm, sequence-sharded
    # The attention's saved bytes without and with selective checkpointing, and the projections
    # reading the attention norm's output.
    attention, attention_kept, projections = _attention_terms(m, S, c, cp)
    inputs = (projections + 2) * S * D * 2 if cast else 2 * S * D * c
    none = 2 * norm + inputs + (attention + 4 * F * S * c) // tp
    full = S * D * r // tp
    selective = full + (attention_kept + 2 * F * S * c) // tp + 2 * S * D * c
    moe = {}
    if m.n_experts is not None:
        E, k, Fe, Fs = m.n_experts, m.n_experts_per_token, m.expert_ffn_dim, (m.n_shared_experts or 0) * m.expert_ffn_dim
        moe_inputs = (projections * S * D * 2 + S * D * 4 + (2 * S * D * 2 if Fs else 0)) if cast else 2 * S * D * c
        router = S * E * 4 + S * k * 12 + (4 * S if m.router_norm_topk else 0)
        routed = S * k * D * c + 16 * S * k + 4 * S * k * Fe * c + 4 * S * k * D
        moe = {"moe_block_none": 2 * norm + moe_inputs + attention + router + routed + 4 * S * Fs * c,
               "moe_block_full": full,
               "moe_block_selective": full + attention_kept + S * D * c + S * E * 4 + (2 * S * Fs * c + S * D * c if Fs else 0)}
    return {
        "block_none": none, "block_full": full, "block_selective": selective, **moe,
        # the token ids (int64); under context parallelism the positions too and the mask of this
        # rank's queries over every key (bool), one for all blocks
        "embedding": 8 * S + (8 * S + S * T * cp if cp > 1 else 0),
        # final norm, its gathered output, log-probabilities, targets, the loss's weight total
        "head": norm + S * D * c + S * m.vocab_size * 4 + 8 * S + 4,
        # Kept by a pipeline stage until the micro-batch's backward (PipelineStage's cache).
        "stage_output": S * D * r // tp,
        "stage_logits": S * m.vocab_size * c,  # the last stage's output (whole vocabulary)
        # The logits (whole vocabulary on every tp rank) and their gradient, around the loss.
        "logits_transient": S * m.vocab_size * (4 + (c if c != 4 else 0)),
    }


def _attention_terms(m, S: int, c: int, cp: int = 1) -> tuple[int, int, int]:
    """(bytes one block's attention keeps for backward, those selective checkpointing keeps, how
    many projections read the attention norm's output), for `S` tokens (this rank's) in compute
    bytes `c`; `activation_terms` says what each counts. Under context parallelism the keys and
    values attention keeps are every cp rank's, gathered (selective checkpointing gathers them
    again in the recompute)."""
    H = m.n_heads
    if m.kv_lora_rank is None:
        Q, K = H * m.head_dim, m.n_kv_heads * m.head_dim
        qk_norms = (4 + c) * (Q + K) * S + 4 * S * (H + m.n_kv_heads) if m.qk_norm else 0
        kept = (2 * Q + 2 * K) * S * c + 4 * S * H
        gathered = 2 * K * S * (cp - 1) * c
        return kept + qk_norms + gathered, kept, 3
    n, rope, v, Lq, Lkv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.q_lora_rank, m.kv_lora_rank
    latent = lambda L: 4 * S * L + 4 * S + 2 * S * L * c if L else 0  # noqa: E731  fp32 input, 1/rms, normed, output
    rotated = 4 * S * H * rope + 4 * S * rope + (4 * S * rope if c == 4 else 0)
    # q, k, the values (padded to the query width, or a view of wkv_b's output when as wide), the
    # output (padded width), logsumexp
    width = n + rope
    values = H * width if v < width else H * (n + v)
    attention = (2 * H * width + (H * width + values) * cp) * S * c + 4 * S * H
    kept = (Lq + H * width + Lkv + rope + H * (n + v) + H * width) * S * c + 4 * S * H
    return latent(Lq) + latent(Lkv) + rotated + attention, kept, 2


def kv_cache_bytes(cfg: PlanInputs, dims: ParallelDims) -> int:
    """The rollout's KV cache on one rank (model/kv_cache.py): per layer a key and a value tensor
    of (completions, kv heads on this tp rank, positions, head_dim) in the compute dtype."""
    if cfg.rollout is None:
        return 0
    m = resolve_model(cfg.model)
    rows, positions = cfg.rollout
    kv_heads = (m.n_kv_heads or m.n_heads) // dims.tp
    return m.n_layers * 2 * rows * kv_heads * positions * m.head_dim * compute_bytes(cfg)


def reference_bytes(cfg: PlanInputs) -> int:
    """A frozen whole fp32 copy of the model, on every rank."""
    return 4 * count(cfg.model).total if cfg.reference else 0


def weight_casts(cfg: PlanInputs, dims: ParallelDims, held: dict) -> dict[str, int]:
    """Bytes of the bf16 weight copies autocast makes (cached for the forward, saved for backward)
    per checkpointing mode: every projection and head weight this rank holds, or with
    checkpointing only the head's (inside a checkpointed block they are dropped after forward).
    None in fp32, none under FSDP, which gathers the weights in bf16 itself, and none of a weight
    held in the compute dtype already (a frozen projection, precision.hold_frozen_projections)."""
    if cfg.dtype == "fp32" or (dims.dp_cp > 1 and cfg.parallel.data_parallel == "fsdp"):
        return {"none": 0, "full": 0, "selective": 0}
    head_name = "tok_embeddings.weight" if cfg.model.tie_embeddings and dims.pp == 1 else "output.weight"
    fp32 = {n: d for n, d in held["params"].items() if d["dtype"] == "float32"}
    # Projections and a mixture's stacked expert weights (3-D); a router's gate runs in fp32, uncast.
    blocks = sum(d["param_bytes"] for n, d in fp32.items()
                 if n.startswith("layers.") and len(d["shape"]) >= 2 and ".router." not in n) // 2
    head = fp32[head_name]["param_bytes"] // 2 if head_name in fp32 else 0
    return {"none": blocks + head, "full": head, "selective": head}


def activations(cfg: PlanInputs, dims: ParallelDims, pipeline: dict | None, pp_rank: int,
                casts: dict[str, int] | None = None) -> dict[str, dict]:
    """Per checkpointing mode: `kept` (the most saved for backward at once: by a pipeline at the
    point of its schedule where the in-flight micro-batches' stages hold the most, plus
    autocast's weight copies `casts`) and `peak` (kept + one block's recompute + the logits
    around the loss)."""
    t, p = cfg.train, cfg.parallel
    casts = casts or {}
    if pipeline is None:
        stages, spans = [(cfg.model.n_layers, True, True)], [(0, cfg.model.n_layers)]
        samples, ops = t.micro_batch_size * cfg.rows_per_sample, [(1, 0)]
    else:
        mine = [s for s in pipeline["stages"] if s["pp_rank"] == pp_rank]
        stages = [(s["layers"][1] - s["layers"][0], s["embedding"], s["head"]) for s in mine]
        spans = [tuple(s["layers"]) for s in mine]
        n_mb = pipeline["microbatches"]
        samples = t.micro_batch_size // n_mb
        ops = schedule_actions(p.pp_schedule, n_mb, dims.pp, pp_rank, len(stages))
    a = activation_terms(cfg, samples, dims.tp, residual_bytes(cfg, dims), dims.cp)
    has_last = any(last for _, _, last in stages)
    routed = [sum(is_moe_layer(cfg.model, i) for i in range(lo, hi)) for lo, hi in spans]  # MoE layers a stage
    # What a stage's micro-batch keeps after its forward; a pipeline stage also holds its output.
    outside = {"first": a["embedding"], "last": a["head"] + (a["stage_logits"] if pipeline else 0),
            "middle": a["stage_output"]}
    out = {}
    for mode in ("none", "full", "selective"):
        chunk = [(n - moe) * a[f"block_{mode}"] + moe * a.get(f"moe_block_{mode}", 0) + first * outside["first"]
                 + (outside["last"] if last else outside["middle"]) for (n, first, last), moe in zip(stages, routed)]
        kept = max(accumulate(sign * chunk[stage] for sign, stage in ops)) + casts.get(mode, 0)
        biggest = max(a["block_none"] - a[f"block_{mode}"], a.get("moe_block_none", 0) - a.get(f"moe_block_{mode}", 0))
        peak = kept + biggest + (a["logits_transient"] if has_last else 0)
        out[mode] = {"kept": kept, "peak": peak}
    out["in_flight_microbatches"] = max(accumulate(sign for sign, _ in ops))  # stage-chunks at most
    out["microbatch_samples"] = samples
    return out


def schedule_actions(schedule: str, n_mb: int, pp: int, pp_rank: int, local: int) -> list[tuple[int, int]]:
    """Pipeline rank `pp_rank`'s forwards (+1) and backwards (-1) in the order torch 2.13's
    schedule runs them, each with the index of its stage among the rank's `local` stages."""
    if schedule == "gpipe":  # every forward before any backward
        return [(1, 0)] * n_mb + [(-1, 0)] * n_mb
    if schedule == "1f1b":  # warm-up forwards (the first stage pp of them), then one each
        warm = min(n_mb, pp - pp_rank)
        return [(1, 0)] * warm + [(-1, 0), (1, 0)] * (n_mb - warm) + [(-1, 0)] * warm
    # Interleaved 1F1B (ScheduleInterleaved1F1B): micro-batches go in rounds, a round through
    # each local stage in turn (backwards from the last); after the warm-up each forward is
    # followed by a backward.
    per_round = n_mb // max(1, n_mb // pp)
    total = n_mb * local
    warm = min((local - 1) * per_round + 2 * (pp - 1 - pp_rank), total)
    forward = [(1, (i // per_round) % local) for i in range(total)]
    backward = [(-1, local - 1 - (i // per_round) % local) for i in range(total)]
    ops = forward[:warm]
    for i in range(warm, total):
        ops += [forward[i], backward[i - warm]]
    return ops + backward[total - warm:]


def _transient(cfg: PlanInputs, dims: ParallelDims, held: dict, grads: int) -> int:
    """Communication buffers, estimated: FSDP's gathered parameters (the root's for the whole
    pass, the current, prefetched and kept-last block, one block's unsharded fp32 gradient
    before its reduce-scatter), or DDP's gradient buckets (a second copy of the gradients)."""
    if dims.dp_cp == 1:
        return 0
    if cfg.parallel.data_parallel == "ddp":
        return grads
    pd = compute_bytes(cfg)
    matrices, gains = block_numel(cfg, dims.tp, dims.ep)
    names = held["params"]
    root = sum(numel(d["shape"]) // (dims.tp if "tp" in d["placements"] and d["placements"]["tp"] != "Replicate"
                                     else 1)
               for n, d in names.items() if not n.startswith("layers."))
    blocks = min(3, sum(1 for n in names if n.endswith("attention_norm.weight")))
    return root * pd + (matrices + gains) * (blocks * pd + 4)


def memory(ranks: dict[int, dict], dims: ParallelDims, cfg: PlanInputs, pipeline: dict | None,
           limit: int | None) -> dict:
    """The plan's memory section (`make_plan(...)["memory"]`) from `ranks` (rank -> what it holds,
    as `plan.simulate` finds it): per rank its parameters, gradients, optimizer states, activations
    and communication buffers; the largest rank; and, given a device of `limit` bytes, whether that
    rank fits, with the verdict's line."""
    mode = cfg.train.activation_checkpoint
    rows: dict[int, dict] = {}
    for rank, held in ranks.items():
        params = sum(d["param_bytes"] for d in held["params"].values())
        grads = sum(d["grad_bytes"] for d in held["params"].values())
        optim = sum(d["optim_bytes"] for d in held["params"].values())
        act = activations(cfg, dims, pipeline, held["pp"], weight_casts(cfg, dims, held))
        transient = _transient(cfg, dims, held, grads)
        reference, kv = reference_bytes(cfg), kv_cache_bytes(cfg, dims)
        # The rollout's cache lives while sampling, the activations in backward: the larger counts.
        total = params + grads + optim + reference + max(act[mode]["peak"], kv) + transient
        rows[rank] = {"params": params, "grads": grads, "optimizer": optim, "activations": act,
                      "transient": transient, "reference": reference, "kv_cache": kv, "total": total}
    per_rank = []
    for rank in range(dims.world_size):  # replicas hold what their dp_replicate-0 twin holds
        twin = rank_of(dims, dims.coordinate(rank) | {"dp_replicate": 0})
        if twin in rows:
            per_rank.append({"rank": rank, **rows[twin]})
    worst = max(per_rank, key=lambda r: r["total"])
    out = {"activation_checkpoint": mode, "per_rank": per_rank, "world_size": dims.world_size,
           "ranks_covered": len(per_rank),
           "largest": {"rank": worst["rank"], "total": worst["total"]}, "device_memory": limit, "fits": None}
    if limit is not None:
        out["fits"] = worst["total"] <= limit
        out["verdict"] = _verdict(worst, limit, mode)
        if not out["fits"] and (hint := _context_parallel_hint(worst, dims, cfg, pipeline, limit)):
            out["verdict"] += "; " + hint
    return out


LONG_CONTEXT = 8192
"""From this sequence length on (or with cp > 1) `plan` shows the activations against sequence
length and cp (`context_table`)."""


def context_table(cfg: PlanInputs, dims: ParallelDims, pipeline: dict | None, pp_rank: int) -> dict | None:
    """The activations' peak per rank (at the recipe's activation checkpointing, on pipeline rank
    `pp_rank`) for sequence lengths from a quarter of the recipe's to four times it, at cp 1, 2, 4, 8
    and 16 (and the recipe's): each rank then keeps seq_len / cp tokens of every sequence and the
    gathered keys and values of the whole; a cell is None where the sequence does not split into the
    chunks that degree needs (2 x cp x tp with head-tail balancing). None below `LONG_CONTEXT` at cp 1."""
    if dims.cp == 1 and cfg.train.seq_len < LONG_CONTEXT:
        return None
    mode, chunks = cfg.train.activation_checkpoint, 2 if cfg.parallel.cp_load_balance == "head_tail" else 1
    seq_lens = [cfg.train.seq_len * f // 4 for f in (1, 2, 4, 8, 16) if cfg.train.seq_len * f % 4 == 0]
    cps = sorted({1, 2, 4, 8, 16, dims.cp})
    rows = []
    for seq_len in seq_lens:
        trial_cfg = dataclasses.replace(cfg, train=cfg.train.model_copy(update={"seq_len": seq_len}))
        cells = []
        for cp in cps:
            fits = cp == 1 or seq_len % (chunks * cp * dims.tp) == 0
            trial = dataclasses.replace(dims, cp=cp)
            cells.append(activations(trial_cfg, trial, pipeline, pp_rank)[mode]["peak"] if fits else None)
        rows.append({"seq_len": seq_len, "peak": cells})
    return {"activation_checkpoint": mode, "cp": cps, "rows": rows, "seq_len": cfg.train.seq_len,
            "recipe_cp": dims.cp, "microbatch_samples": cfg.train.micro_batch_size}


def _context_parallel_hint(worst: dict, dims: ParallelDims, cfg: PlanInputs, pipeline: dict | None,
                           limit: int) -> str | None:
    """The smallest context-parallel degree that fits on the same ranks, dp_shard traded for cp:
    FSDP then shards over the same dp_shard x cp ranks (parameters, gradients and optimizer states
    stay as they are) and each rank keeps the activations of seq_len / cp tokens (with every key
    and value gathered). None when none does, or the layout cannot take it (parallel/dims.py)."""
    mode, t = cfg.train.activation_checkpoint, cfg.train
    now = worst["activations"][mode]["peak"]
    chunks = 2 if cfg.parallel.cp_load_balance == "head_tail" else 1
    if (dims.pp > 1 and dims.tp > 1) or dims.ep > 1 or cfg.model.n_experts is not None \
            or cfg.parallel.data_parallel == "ddp":
        return None
    pp_rank = dims.coordinate(worst["rank"])["pp"]
    k = 2
    while dims.dp_shard % k == 0 and t.seq_len % (chunks * dims.cp * k * dims.tp) == 0:
        trial = dataclasses.replace(dims, dp_shard=dims.dp_shard // k, cp=dims.cp * k)
        need = worst["total"] - now + activations(cfg, trial, pipeline, pp_rank)[mode]["peak"]
        if need <= limit:
            return (f"on the same ranks parallel.cp = {trial.cp} (dp_shard = {trial.dp_shard}) would fit "
                    f"(~{human(need)}: each rank keeps {t.seq_len // trial.cp:,} of each sequence's "
                    f"{t.seq_len:,} tokens)")
        k *= 2
    return None


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
