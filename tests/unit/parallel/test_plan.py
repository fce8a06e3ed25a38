"""`trainbook plan` in one process: TP plan keys, batch arithmetic, sizes, text and JSON output.

Exact bytes per rank against real gloo ranks, and the activation estimate against saved-tensor
hooks, are in tests/dist/test_plan.py.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from torch import nn

from tests import readme
from tests.conftest import REPO
from trainbook.config.model import ModelConfig
from trainbook.errors import TrainbookError
from trainbook.model import build_model, names, num_params, resolve
from trainbook.model.llama import RMSNorm
from trainbook.parallel.apply import tp_plan
from trainbook.parallel.plan_memory import human, numel
from trainbook.parallel.pipeline import cut_stage, model_stage_layers
from trainbook.parallel.plan_text import render
from trainbook.commands.plan import plan_command

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "tiny-shakespeare.toml"
TINY = ["model.name=tiny", "train.seq_len=32", "train.micro_batch_size=2"]
# Llama 3 8B as pre-trained: 4096-token sequences, one per micro-batch, 8 per step (fp32 weights).
LLAMA8B = ["model.name=llama3-8b", "model.vocab_size=128256", "train.seq_len=4096", "train.micro_batch_size=1",
           "train.global_batch_tokens=32768"]
GiB = 1 << 30


def plan_json(world_size: int, overrides: list[str], memory: str | None = None) -> dict:
    return json.loads(plan_command(RECIPE, overrides, world_size, memory, as_json=True))


# ---- TP plan keys -------------------------------------------------------------------------------

# A mixture of experts has no TP plan yet: resolution refuses tp > 1 for it (parallel/heads.py).
@pytest.mark.parametrize("name", [n for n in names() if resolve(ModelConfig(name=n)).n_experts is None])
def test_every_tp_plan_key_is_a_module_and_every_weight_has_a_plan(name):
    cfg = resolve(ModelConfig(name=name))
    model = build_model(cfg, "meta", seed=0)
    plan = tp_plan(model)
    # Nothing filtered away on the whole model: 3 root entries + 11 per block (13 with q/k
    # norms), all real modules.
    assert len(plan) == 3 + (13 if cfg.qk_norm else 11) * len(model.layers)
    for path in plan:
        assert model.get_submodule(path) is not None, path
    # ...and every matrix and norm of the model is covered by one, so every parameter (a
    # projection's bias too) is placed by its module's style.
    weights = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding, RMSNorm))}
    assert weights <= set(plan), weights - set(plan)
    assert {n.rsplit(".", 1)[0] for n, _ in model.named_parameters()} <= set(plan)


def test_tp_plan_of_a_pipeline_stage_names_only_its_own_modules():
    model = build_model(resolve(ModelConfig(name="debug", n_layers=4)), "meta", seed=0)
    layers = model_stage_layers(model, 2, None)
    for i, r in enumerate(layers):
        stage = cut_stage(model, r, is_first=i == 0, is_last=i == 1)
        plan = tp_plan(stage)
        assert all(stage.get_submodule(path) is not None for path in plan)
        assert ("tok_embeddings" in plan) == (i == 0) and ("output" in plan) == (i == 1)
        assert {p.split(".")[1] for p in plan if p.startswith("layers.")} == {str(j) for j in r}


# ---- sizes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["eighty", "", "GiB", "-5GiB", "0", "80XB", "1.2.3G"])
def test_bad_sizes_are_one_line_errors_naming_the_option(text):
    with pytest.raises(TrainbookError) as e:
        plan_command(RECIPE, TINY, 1, text, as_json=False)
    assert e.value.where == "--device-memory" and "\n" not in str(e.value)


def test_a_layout_that_does_not_fit_the_world_is_a_one_line_error():
    with pytest.raises(TrainbookError, match="parallel"):
        plan_command(RECIPE, TINY + ["parallel.tp=3", "parallel.dp_shard=1"], 4, None, as_json=False)
    with pytest.raises(TrainbookError, match="divisible by tp"):
        plan_command(RECIPE, TINY + ["parallel.tp=4", "parallel.dp_shard=1"], 4, None, as_json=False)


# ---- batch --------------------------------------------------------------------------------------

def test_batch_arithmetic():
    # 8192 tokens per step = 256 samples of 32; 2 data-parallel ranks x 2 per micro-batch -> 64 passes.
    b = plan_json(4, TINY + ["train.global_batch_tokens=8192", "parallel.dp_shard=2", "parallel.tp=2"])["batch"]
    assert b == {"seq_len": 32, "global_batch_tokens": 8192, "global_samples": 256, "data_parallel_ranks": 2,
                 "micro_batch_size": 2, "accum_steps": 64, "samples_per_rank": 128, "tokens_per_rank": 4096}
    # Pipelines cut each micro-batch into chunks: 4 samples into 2 of 2.
    b = plan_json(2, TINY + ["train.micro_batch_size=4", "parallel.pp=2", "parallel.dp_shard=1"])["batch"]
    assert (b["accum_steps"], b["pp_microbatches"], b["pp_microbatch_samples"]) == (16, 2, 2)


# ---- layouts of the tiny model ------------------------------------------------------------------

def test_mesh_groups_follow_the_row_major_rank_order():
    mesh = plan_json(8, TINY + ["parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2"])["mesh"]
    assert mesh["groups"] == {"pp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp_shard": [[0, 2], [1, 3], [4, 6], [5, 7]],
                              "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    assert mesh["same_data"] == [[0, 1, 4, 5], [2, 3, 6, 7]]  # tp and pp ranks of one data-parallel rank


def test_placements_fsdp_times_tp():
    params = {p["name"]: p for p in plan_json(4, TINY + ["parallel.dp_shard=2", "parallel.tp=2"])["params"]}
    wq, wo, norm = params["layers.0.attention.wq.weight"], params["layers.0.attention.wo.weight"], params["norm.weight"]
    # Column-parallel wq: rows split by tp, then FSDP splits each tp shard's rows again.
    assert wq["placements"] == {"dp_shard": "StridedShard(0)", "tp": "Shard(0)"} and wq["local_shape"] == [48, 192]
    assert wo["placements"] == {"dp_shard": "Shard(0)", "tp": "Shard(1)"} and wo["local_shape"] == [96, 96]
    assert norm["placements"] == {"dp_shard": "Shard(0)", "tp": "Replicate"} and norm["local_shape"] == [96]
    assert "output.weight" not in params  # tied: one tensor


def test_placements_of_the_family_options_fsdp_times_tp():
    """q/k/v biases split with their projections' rows; q/k norms (one gain of head_dim = 32
    shared by all heads) whole on every tp rank, FSDP sharding them like the block norms."""
    params = {p["name"]: p for p in plan_json(4, TINY + ["model.name=qwen3-tiny", "model.qkv_bias=true",
                                                         "parallel.dp_shard=2", "parallel.tp=2"])["params"]}
    for proj, rows in (("wq", 256), ("wk", 64), ("wv", 64)):
        bias = params[f"layers.0.attention.{proj}.bias"]
        assert bias["shape"] == [rows] and bias["local_shape"] == [rows // 4], proj
        assert bias["placements"] == {"dp_shard": "StridedShard(0)", "tp": "Shard(0)"}, proj
    for norm in ("q_norm", "k_norm"):
        gain = params[f"layers.0.attention.{norm}.weight"]
        assert gain["shape"] == [32] and gain["local_shape"] == [16], norm
        assert gain["placements"] == {"dp_shard": "Shard(0)", "tp": "Replicate"}, norm
    # With tp alone, each tp rank holds the whole gain and half of each bias.
    params = {p["name"]: p for p in plan_json(2, TINY + ["model.name=qwen3-tiny", "model.qkv_bias=true",
                                                         "parallel.dp_shard=1", "parallel.tp=2"])["params"]}
    assert params["layers.0.attention.q_norm.weight"]["local_shape"] == [32]
    assert params["layers.0.attention.wk.bias"]["local_shape"] == [32]


def test_pipeline_stages_and_who_holds_them():
    plan = plan_json(2, TINY + ["parallel.pp=2", "parallel.dp_shard=1"])
    stages = plan["pipeline"]["stages"]
    assert [(s["layers"], s["embedding"], s["head"], s["ranks"]) for s in stages] == [
        ([0, 2], True, False, [0]), ([2, 4], False, True, [1])]
    params = {p["name"]: p for p in plan["params"]}
    assert params["layers.1.attention.wq.weight"]["first_rank"] == 0
    assert params["layers.2.attention.wq.weight"]["first_rank"] == 1
    # Tied embeddings across stages: the head holds its own copy on the last stage.
    assert params["tok_embeddings.weight"]["first_rank"] == 0 and params["output.weight"]["first_rank"] == 1
    assert any(g["dim"] == "pp" and "tied" in g["text"] for g in plan["gradient_path"])


def test_uneven_fsdp_chunks_are_reported_per_rank():
    plan = plan_json(2, TINY + ["model.vocab_size=1001", "parallel.dp_shard=2"])
    emb = next(p for p in plan["params"] if p["name"] == "tok_embeddings.weight")
    assert emb["local_shape"] == [501, 192] and emb["largest_local_shape"] == [501, 192]
    first, second = plan["memory"]["per_rank"]
    assert first["params"] - second["params"] == 192 * 4  # rank 1 holds one row fewer


def test_the_fake_process_group_leaves_nothing_behind():
    hook = sys.excepthook
    plan_json(2, TINY + ["parallel.dp_shard=2"])
    assert not dist.is_initialized()
    assert sys.excepthook is hook  # init_process_group prefixes it with "[rank<R>]"


def test_plan_inside_a_job_that_has_a_process_group(tmp_path):
    """Then placement runs in a spawned process; the job's own group is left alone."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        plan = plan_json(2, TINY + ["parallel.dp_shard=2"])
        assert dist.is_initialized() and dist.group.WORLD is group and dist.get_world_size() == 1
        assert plan["params"][0]["local_shape"] == [512, 192]
    finally:
        dist.destroy_process_group()


# ---- Llama 3 8B on 1, 2, 4, 8 ranks of 80 GiB -----------------------------------------------------

LAYOUTS_8B = {
    "1": (1, []),
    "2 fsdp": (2, ["parallel.dp_shard=2"]),
    "4 fsdp x tp": (4, ["parallel.dp_shard=2", "parallel.tp=2"]),
    "8 fsdp full-ac": (8, ["parallel.dp_shard=8", "train.activation_checkpoint=full"]),
    # Two sequences per micro-batch: ~100 GiB of activations unless checkpointed.
    "8 fsdp mb2": (8, ["parallel.dp_shard=8", "train.micro_batch_size=2", "train.global_batch_tokens=65536"]),
}


@pytest.fixture(scope="module")
def llama8b() -> dict[str, dict]:
    return {k: plan_json(n, LLAMA8B + o, "80GiB") for k, (n, o) in LAYOUTS_8B.items()}


def test_llama3_8b_on_one_rank_does_not_fit_80gib(llama8b):
    plan = llama8b["1"]
    n = num_params(build_model(resolve(ModelConfig(name="llama3-8b")), "meta", seed=0))
    assert n == plan["model"]["params"] == 8_030_261_248
    rank = plan["memory"]["per_rank"][0]
    # fp32 weights, fp32 gradients, AdamW: two fp32 moments + a 4-byte step per tensor (291 tensors).
    assert rank["params"] == rank["grads"] == 4 * n
    assert rank["optimizer"] == 8 * n + 4 * 291
    assert rank["params"] + rank["grads"] + rank["optimizer"] > 119 * GiB
    assert plan["memory"]["fits"] is False and plan["memory"]["verdict"].startswith("DOES NOT FIT")
    text = plan_command(RECIPE, LLAMA8B, 1, "80GiB", as_json=False)
    assert "DOES NOT FIT: rank 0 needs" in text.splitlines()[-1]


def test_llama3_8b_sharded_8_ways_with_checkpointing_fits(llama8b):
    plan = llama8b["8 fsdp full-ac"]
    assert plan["memory"]["fits"] is True and plan["memory"]["verdict"].startswith("FITS")
    ranks = plan["memory"]["per_rank"]
    assert len(ranks) == 8
    # FSDP partitions every tensor: the shards add up to the whole model, exactly.
    assert sum(r["params"] for r in ranks) == 4 * plan["model"]["params"]
    assert all(abs(r["params"] - 4 * plan["model"]["params"] / 8) < 1 << 20 for r in ranks)
    act = ranks[0]["activations"]
    # Activations of one 4096-token sequence: tens of GiB without checkpointing, a few with it.
    assert 30 * GiB < act["none"]["peak"] < 70 * GiB
    assert 2 * GiB < act["full"]["peak"] < act["selective"]["peak"] < act["none"]["peak"]
    assert ranks[0]["total"] < 40 * GiB
    # Without checkpointing the same layout does not fit, and the verdict says what would.
    no_ac = llama8b["8 fsdp mb2"]["memory"]
    assert no_ac["fits"] is False and "activation_checkpoint = full would fit" in no_ac["verdict"]


def test_lora_on_llama3_8b_holds_the_frozen_base_and_trains_only_the_adapters(llama8b):
    """The same 8B on one 80 GiB rank with rank-16 adapters on every linear layer of the blocks:
    the base's weights stay (fp32 in an fp32 run, as the trainer holds them), its gradients and
    AdamW state go."""
    plan = plan_json(1, LLAMA8B + ["lora.rank=16"], "80GiB")
    n = plan["model"]["params"]
    # Per block r (in + out) for wq, wk, wv, wo (4096 -> 4096, 1024, 1024, 4096) and w1, w3, w2 (4096 <-> 14336).
    adapters = 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * 18432)
    assert plan["lora"] == {"rank": 16, "alpha": 16.0, "trainable_params": adapters == 41_943_040 and adapters}
    rank, full = plan["memory"]["per_rank"][0], llama8b["1"]["memory"]["per_rank"][0]
    assert rank["params"] == 4 * (n + adapters)
    assert rank["grads"] == 4 * adapters
    assert rank["optimizer"] == 8 * adapters + 4 * 32 * 7 * 2  # two moments, and a step per A and per B
    assert full["total"] - rank["total"] > 85 * GiB
    assert plan["memory"]["fits"] is True
    text = plan_command(RECIPE, LLAMA8B + ["lora.rank=16"], 1, "80GiB", as_json=False)
    assert "LoRA rank 16, alpha 16: 41,943,040 adapter parameters train" in text

    # Computing in bf16, the frozen projections (blocks and head) are held in bf16, as the trainer
    # holds them; the embedding table, norms and adapters stay fp32.
    bf16 = plan_json(1, LLAMA8B + ["lora.rank=16", "precision.dtype=bf16"], "80GiB")
    projections = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 128256 * 4096
    assert bf16["memory"]["per_rank"][0]["params"] == 2 * projections + 4 * (n - projections + adapters)


def test_more_ranks_hold_less_each(llama8b):
    totals = [max(r["total"] for r in llama8b[k]["memory"]["per_rank"]) for k in ("1", "2 fsdp", "4 fsdp x tp")]
    assert totals == sorted(totals, reverse=True)
    states = [llama8b[k]["memory"]["per_rank"][0]["optimizer"] for k in ("1", "2 fsdp", "4 fsdp x tp", "8 fsdp mb2")]
    assert states[0] / states[1] == pytest.approx(2, rel=1e-3) and states[0] / states[3] == pytest.approx(8, rel=1e-3)


@pytest.mark.parametrize("key", ["1", "2 fsdp", "4 fsdp x tp", "8 fsdp full-ac"])
def test_text_and_json_say_the_same(llama8b, key):
    world_size = LAYOUTS_8B[key][0]
    plan = llama8b[key]
    assert set(plan) == {"recipe", "world_size", "model", "precision", "lora", "mesh", "pipeline", "params", "batch",
                         "gradient_path", "gradient_remedies", "memory", "expect"}
    assert plan["lora"] is None
    text = render(plan)  # what plan_command prints without --json
    headings = [line for line in text.splitlines() if line and not line.startswith(" ")]
    assert [h.split()[0].rstrip(":") for h in headings[:-1]] == [
        "plan", "model", "Mesh", "Pipeline", "Parameters", "Batch", "Gradient", "Memory"]
    assert headings[-1] == plan["memory"]["verdict"]
    # Each block's parameters appear once, collapsed over the 32 blocks.
    assert re.search(r"layers\.\*\.attention\.wq\.weight \(x32\)\s+4096 x 4096", text)
    assert ("reduce-scatter each block's gradient" in text) == (world_size > 1)
    assert ("  tp " in text) == (world_size == 4)  # the tp rows of the mesh and of the gradient path
    # What FSDP without tp could reduce-scatter instead: in text as in JSON (none under tp, none on one rank).
    assert len(plan["gradient_remedies"]) == (world_size in (2, 8))
    assert all(f"    {r}" in text for r in plan["gradient_remedies"])
    if plan["gradient_remedies"]:
        assert plan["gradient_remedies"][0].startswith('parallel.reduce_dtype = "bf16" (each pass\'s gradient reduce-scatter:')


# ---- Qwen on 8 ranks: the published parameter counts ---------------------------------------------

QWEN_8_RANKS = {
    # Qwen3-8B: 32 heads / 8 kv heads, so tp 8 holds one kv head per rank; q/k norms replicated.
    "qwen3-8b": (["model.vocab_size=151936", "parallel.dp_shard=1", "parallel.tp=8"], 8_190_735_360),
    # Qwen2.5-7B: 28 heads / 4 kv heads (tp 8 does not divide them): FSDP over 8; q/k/v biases.
    "qwen2.5-7b": (["model.vocab_size=152064", "parallel.dp_shard=8"], 7_615_616_512),
}


@pytest.mark.parametrize("name", QWEN_8_RANKS)
def test_qwen_plans_on_8_ranks_count_the_published_parameters(name):
    """The exact counts of the models' safetensors (Qwen/Qwen3-8B, Qwen/Qwen2.5-7B on Hugging
    Face), on the meta device: every rank's shards add up to them, each tensor once."""
    overrides, published = QWEN_8_RANKS[name]
    args = [f"model.name={name}", "train.seq_len=4096", "train.micro_batch_size=1",
            "train.global_batch_tokens=32768", *overrides]
    plan = plan_json(8, args, "80GiB")
    assert plan["model"]["params"] == published
    assert render(plan).splitlines()[1].startswith(f"model {name}: {published:,} parameters (")  # as printed
    # Each tensor once in the placements; a rank holds an eighth of the split ones (FSDP: every
    # tensor, padded dim-0 chunks; tp: all but the norm gains, whole on every rank), fp32.
    params = plan["params"]
    assert sum(numel(p["shape"]) for p in params) == published
    whole = sum(numel(p["shape"]) for p in params if p["placements"].get("tp") == "Replicate")
    held = plan["memory"]["per_rank"][0]["params"]
    assert abs(held - 4 * ((published - whole) / 8 + whole)) < 1 << 20, held


def test_the_readme_shows_the_context_parallel_degree_plan_names():
    """The README's 32K Llama 3 8B transcript: the table of activations against sequence length and
    cp, and the verdict line, are what `plan` prints now, as they end its memory section."""
    [(command, shown)] = readme.transcript(readme.block_after("it names the context-parallel degree that would on the"))
    args = shlex.split(command)
    assert args[:2] == ["trainbook", "plan"] and args[-2:] == ["--device-memory", "80GiB"] and shown[0] == "..."
    printed = plan_command(REPO / args[2], args[3:-2], None, "80GiB", False).splitlines()
    start = printed.index(shown[1])
    assert printed[start:start + len(shown) - 1] == shown[1:], "\n".join(printed[start:start + len(shown)])


def test_long_context_plans_table_activations_against_sequence_length_and_cp():
    """The table's recipe cell is the activations the memory rows count for the recipe's rank;
    every other cell is the same arithmetic at another length and degree: at a fixed length a
    rank's activations fall as cp grows (it keeps seq_len / cp tokens, but every key and value),
    at a fixed cp they grow with the length. A short sequence at cp = 1 has no table."""
    args = ["model.name=llama3-8b", "model.vocab_size=128256", "train.seq_len=32768", "model.max_seq_len=32768",
            "train.micro_batch_size=1", "train.global_batch_tokens=262144", "parallel.cp=4", "parallel.dp_shard=2"]
    plan = plan_json(8, args, "80GiB")
    table, mode = plan["memory"]["context"], plan["memory"]["activation_checkpoint"]
    assert table["cp"] == [1, 2, 4, 8, 16] and [r["seq_len"] for r in table["rows"]] == [8192, 16384, 32768, 65536, 131072]
    recipe = next(r for r in table["rows"] if r["seq_len"] == 32768)["peak"][table["cp"].index(4)]
    assert recipe == plan["memory"]["per_rank"][0]["activations"][mode]["peak"]
    for row in table["rows"]:
        assert row["peak"] == sorted(row["peak"], reverse=True) and len(set(row["peak"])) == 5, row
    for column in zip(*(r["peak"] for r in table["rows"])):
        assert list(column) == sorted(column) and len(set(column)) == 5, column
    assert "[" + human(recipe) + "]" in render(plan)
    assert plan_json(1, TINY)["memory"]["context"] is None
