"""Families: the Qwen entries' parameter counts against the published ones, the one count (meta
model) against what a step computes, and old saved configs reading as the model they were built as."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainbook.config.model import ModelConfig
from trainbook.model import build_model, count, names, resolve
from trainbook.model.families import FAMILIES, with_options
from trainbook.model.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[3]

# Exact published counts: model.safetensors.index.json `metadata.total_size` / 2 (bf16 weights,
# Qwen2.5-7B, Qwen3-4B/8B/32B), or keras-hub's preset parameter counts (the single-file models);
# and the model cards' rounded totals and non-embedding figures (both vocab x dim matrices left
# out), in billions. A tied head is counted once.
PUBLISHED = {
    "qwen2.5-0.5b": (494_032_768, 0.49, 0.36),
    "qwen2.5-1.5b": (1_543_714_304, 1.54, 1.31),
    "qwen2.5-7b": (7_615_616_512, 7.61, 6.53),
    "qwen3-0.6b": (596_049_920, 0.6, 0.44),
    "qwen3-1.7b": (1_720_574_976, 1.7, 1.4),
    "qwen3-4b": (4_022_468_096, 4.0, 3.6),
    "qwen3-8b": (8_190_735_360, 8.2, 6.95),
    "qwen3-32b": (32_762_123_264, 32.8, 31.2),
}


def _card_figure(x: float, card: float) -> bool:
    """`x` (billions) agrees with a card figure to within one unit of its last digit (Qwen2.5-7B's
    card says 7.61B for 7.6156B: cards do not always round to nearest)."""
    digits = len(f"{card}".split(".")[1])
    return abs(x - card) <= 10**-digits


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_every_qwen_entry_has_its_published_parameter_count(name):
    exact, card_total, card_non_embedding = PUBLISHED[name]
    c = count(ModelConfig(name=name))
    assert c.total == exact
    assert c.active == c.total  # dense
    cfg = resolve(ModelConfig(name=name))
    vocab_matrices = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
    assert _card_figure(c.total / 1e9, card_total)
    assert _card_figure((c.total - vocab_matrices) / 1e9, card_non_embedding)


def test_qwen3_30b_a3b_has_its_published_parameter_counts():
    """Exactly model.safetensors.index.json's `total_size` / 2 (61,064,245,248 bf16 bytes), and
    the model card's 30.5B parameters, 3.3B activated, 29.9B non-embedding. Active per token:
    attention, norms, the router and 8 of the 128 experts in each of the 48 layers, and both
    151,936 x 2048 vocabulary matrices (untied)."""
    c = count(ModelConfig(name="qwen3-30b-a3b"))
    cfg = resolve(ModelConfig(name="qwen3-30b-a3b"))
    assert c.total == 30_532_122_624 and c.active == 3_353_032_704
    assert _card_figure(c.total / 1e9, 30.5) and _card_figure(c.active / 1e9, 3.3)
    assert _card_figure((c.total - 2 * cfg.vocab_size * cfg.dim) / 1e9, 29.9)
    experts = cfg.n_layers * cfg.n_experts * 3 * cfg.dim * cfg.expert_ffn_dim
    assert c.total - c.active == experts * (cfg.n_experts - cfg.n_experts_per_token) // cfg.n_experts


def test_the_registry_has_the_families_entries():
    for name in PUBLISHED:
        assert name in names() and REGISTRY[name]["family"] in FAMILIES
        assert REGISTRY[name]["source"].endswith(f"{name.replace('qwen', 'Qwen').replace('b', 'B')}/blob/main/config.json")


def test_the_count_adds_up_over_a_built_model():
    cfg = resolve(ModelConfig(name="qwen3-tiny", n_layers=2, vocab_size=300, qkv_bias=True))
    model = build_model(cfg, "cpu", seed=0)
    c, block = count(cfg), model.layers["0"]
    assert c.total == sum(p.numel() for p in model.parameters())
    assert c.block_replicated == 2 * cfg.dim + 2 * cfg.head_dim  # two norms; q and k norms
    assert c.block_sharded + c.block_replicated == sum(p.numel() for p in block.parameters())


def test_the_old_hand_formula_was_wrong_where_heads_are_wider_than_dim():
    """Qwen3-4B: 32 heads x 128 = 4096 channels against dim 2560. The formula that took the
    attention projections as 2 x dim x dim (and kv as n_kv_heads x dim / n_heads) undercounts."""
    m = resolve(ModelConfig(name="qwen3-4b"))
    old_head_dim = m.dim // m.n_heads
    old_per_layer = 2 * m.dim * m.dim + 2 * m.dim * m.n_kv_heads * old_head_dim + 3 * m.dim * m.ffn_dim
    old = 6 * (m.n_layers * old_per_layer + m.dim * m.vocab_size) + 12 * m.n_layers * m.n_heads * old_head_dim * 4096
    new = count(m).flops_per_token(4096)
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    per_layer = 2 * m.dim * q + 2 * m.dim * kv + 3 * m.dim * m.ffn_dim
    assert new == 6 * (m.n_layers * per_layer + m.dim * m.vocab_size) + 12 * m.n_layers * q * 4096
    assert new / old > 1.1


def test_a_baseline_written_before_families_reads_as_the_model_it_was_built_as():
    saved = json.loads((ROOT / "recipes/baselines/tiny-shakespeare.json").read_text())["config"]["model"]
    assert "family" not in saved and "head_dim" not in saved  # written before the options existed
    today = resolve(ModelConfig(**{k: v for k, v in saved.items()}))
    assert with_options(saved) == today.model_dump(mode="json", exclude_none=True)
    assert with_options({"name": "from_hf"}) == {"name": "from_hf"}  # nothing to complete from
