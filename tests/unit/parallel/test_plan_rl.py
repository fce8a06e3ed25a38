"""`trainbook plan` for post-training: the rollout's KV cache as the sampler allocates it, the
frozen reference as the model's own parameters, a DPO sample as two rows, and the recipes' plans
naming them."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import RECIPES
from trainbook.commands.plan import plan_command
from trainbook.config import ParallelConfig, TrainConfig
from trainbook.config.model import ModelConfig
from trainbook.model import build_model, resolve
from trainbook.model.kv_cache import KVCache
from trainbook.parallel.dims import ParallelDims
from trainbook.parallel.plan_memory import PlanInputs, activations, kv_cache_bytes, reference_bytes

ONE = ParallelDims(1, 1, 1, 1)


@pytest.mark.parametrize("family", [{}, {"n_kv_heads": 2}, {"qk_norm": True, "head_dim": 32}],
                         ids=["mha", "gqa", "head-dim"])
def test_the_kv_cache_is_what_the_sampler_allocates(family):
    cfg = ModelConfig(name="debug", max_seq_len=32, **family)
    model = build_model(cfg, "cpu", seed=0).eval()
    rows, capacity = 3, 20
    cache = KVCache(torch.ones(rows, capacity, dtype=torch.bool))
    with torch.no_grad():
        model(torch.zeros(rows, 5, dtype=torch.long), torch.arange(5).expand(rows, 5), cache=cache)
    held = sum(t.numel() * t.element_size() for layer in cache.layers.values() for t in (layer.k, layer.v))
    inputs = PlanInputs(cfg, TrainConfig(), ParallelConfig(), "fp32", rollout=(rows, capacity))
    assert kv_cache_bytes(inputs, ONE) == held > 0
    assert reference_bytes(PlanInputs(cfg, TrainConfig(), ParallelConfig(), "fp32", reference=True)) == \
        4 * sum(p.numel() for p in model.parameters())


def test_a_dpo_sample_is_two_rows_of_activations():
    cfg = resolve(ModelConfig(name="debug", max_seq_len=32))
    pairs = activations(PlanInputs(cfg, TrainConfig(seq_len=32, micro_batch_size=4), ParallelConfig(), "fp32",
                                   rows_per_sample=2), ONE, None, 0)
    rows = activations(PlanInputs(cfg, TrainConfig(seq_len=32, micro_batch_size=8), ParallelConfig(), "fp32"),
                       ONE, None, 0)
    assert pairs == rows


def test_the_recipes_plans_count_the_reference_and_the_cache():
    grpo = json.loads(plan_command(RECIPES / "arith-grpo.toml", ["grpo.kl_coef=0.04"], None, None, True))
    row = grpo["memory"]["per_rank"][0]
    model = build_model(ModelConfig(name="tiny", vocab_size=264, max_seq_len=128), "meta", seed=0)
    assert row["reference"] == 4 * sum(p.numel() for p in model.parameters())
    m = resolve(ModelConfig(name="tiny"))  # 4 layers, 2 kv heads of 32
    # 512 completions (64 prompts x 8) of up to seq_len 24 positions, each layer's k and v, fp32.
    assert row["kv_cache"] == 512 * 24 * m.n_layers * 2 * m.n_kv_heads * m.head_dim * 4 == 24 * 2**20
    assert row["total"] == row["params"] + row["grads"] + row["optimizer"] + row["reference"] + row["transient"] + \
        max(row["kv_cache"], row["activations"]["none"]["peak"])
    off = json.loads(plan_command(RECIPES / "arith-grpo.toml", [], None, None, True))["memory"]["per_rank"][0]
    assert off["reference"] == 0 and off["kv_cache"] == row["kv_cache"]
    dpo = json.loads(plan_command(RECIPES / "arith-dpo.toml", ["dpo.reference=frozen"], None, None, True))
    assert dpo["memory"]["per_rank"][0]["reference"] == row["reference"] and dpo["memory"]["per_rank"][0]["kv_cache"] == 0
    text = plan_command(RECIPES / "arith-grpo.toml", ["grpo.kl_coef=0.04"], None, None, False)
    assert "for the frozen reference model" in text and "for the rollout's KV cache" in text
