"""Qwen3-MoE against transformers' own `Qwen3MoeForCausalLM`, built offline on a tiny config that is
nobody's default: 8 experts of 24 hidden units, top-2, the middle of three layers dense through
`mlp_only_layers`, Qwen3's head_dim 24 against a 64-wide residual, GQA, RoPE base 1e6; every
tensor random before it is saved (transformers starts routers at zero). Then: import's logits
against transformers' (both `norm_topk_prob`); export loaded back by transformers; import ->
export -> import bit for bit; which layers route, as transformers decides it; the config.json
refusals. The MoE block alone: tests/unit/model/test_moe.py; DeepSeek-V3: test_hf_deepseek.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.unit.model.test_hf_families import (
    assert_round_trip, export_run, import_hf, logits, save_random, tokens, write_config,
)
from tests.unit.model.test_hf_import import one_line_error
from tests.unit.model.test_moe import ContiguousSilu
from trainbook.config.model import ModelConfig
from trainbook.model import resolve
from trainbook.model.hf import hf_config
from trainbook.model.hf_import import check_against_recipe, model_config_from_hf

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, rope_theta=1e6, max_position_embeddings=64, rms_norm_eps=1e-6,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1])  # fmt: skip
CASES = pytest.mark.parametrize("norm, tie", [(False, False), (True, True)], ids=["raw-untied", "renormalised-tied"])
# Import's logits differ from transformers' by this much at most (fp32, |logits| up to ~4): RoPE's
# tables and silu's rounding of a strided tensor (test_imported_logits_match_transformers).
ATOL = 1e-5


def save_hf(root: Path, norm: bool, tie: bool, **changes) -> tuple[Path, torch.nn.Module]:
    """A random tiny Qwen3-MoE saved by transformers into root/hf; returns (dir, model)."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**SHAPE | changes, norm_topk_prob=norm, tie_word_embeddings=tie)
    return save_random(root, transformers.Qwen3MoeForCausalLM(config))


# ---- parity --------------------------------------------------------------------------------------


@CASES
def test_imported_logits_match_transformers(tmp_path, norm, tie, one_thread):
    path, hf = save_hf(tmp_path, norm, tie)
    files = load_file(path / "model.safetensors")
    # What save_pretrained writes: one tensor per expert (transformers 5 fuses them only in memory).
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in files and "model.layers.2.mlp.gate.weight" in files
    assert not any(".experts.gate_up_proj" in k for k in files)
    assert "model.layers.1.mlp.gate_proj.weight" in files and "model.layers.1.mlp.gate.weight" not in files
    cfg = model_config_from_hf(path)
    assert (cfg.family, cfg.n_experts, cfg.n_experts_per_token, cfg.expert_ffn_dim) == ("qwen3_moe", 8, 2, 24)
    assert (cfg.router_norm_topk, cfg.dense_layers, cfg.ffn_dim, cfg.tie_embeddings) == (norm, (1,), 96, tie)
    model, x = import_hf(path), tokens()
    theirs = logits(hf, x)
    torch.testing.assert_close(logits(model, x), theirs, rtol=0, atol=ATOL)
    # Not bit for bit, for two reasons, each a rounding of one op: RoPE's inverse frequencies
    # (test_hf_families says why), and silu, which transformers applies to a strided half of its
    # fused gate_up output and the CPU kernel rounds differently from a contiguous tensor. With
    # transformers' cos/sin tables in the model and its silu on a contiguous copy, the logits are
    # equal bit for bit: routing, dispatch, the grouped matmuls and the combine all are.
    positions = torch.arange(cfg.max_seq_len)[None]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)  # (1, T, head_dim)
    model.rope_cos.copy_(cos[0, :, : cfg.head_dim // 2])
    model.rope_sin.copy_(sin[0, :, : cfg.head_dim // 2])
    for layer in (hf.model.layers[0], hf.model.layers[2]):
        layer.mlp.experts.act_fn = ContiguousSilu()
    assert torch.equal(logits(model, x), logits(hf, x))


@CASES
def test_export_loads_into_transformers_and_reimports_bit_for_bit(tmp_path, norm, tie):
    path, hf = save_hf(tmp_path, norm, tie)
    model = import_hf(path)
    out = export_run(tmp_path, model.cfg, model.state_dict())

    config = json.loads((out / "config.json").read_text())
    assert (config["num_experts"], config["mlp_only_layers"], config["norm_topk_prob"]) == (8, [1], norm)
    assert_round_trip(path, out, model, hf, transformers.Qwen3MoeForCausalLM)


# ---- config.json ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return save_hf(tmp_path_factory.mktemp("qwen3_moe"), norm=True, tie=False)[0]


@pytest.fixture
def config_dir(saved, tmp_path) -> Path:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text((saved / "config.json").read_text())
    return tmp_path / "hf"


@pytest.mark.parametrize("step, only", [(1, []), (2, []), (1, [0, 3]), (3, [0, 9])])
def test_which_layers_route_is_what_transformers_builds(config_dir, step, only):
    """A layer is dense when `mlp_only_layers` names it or (i + 1) % `decoder_sparse_step` != 0;
    entries past the last layer name nothing."""
    path = write_config(config_dir, num_hidden_layers=4, decoder_sparse_step=step, mlp_only_layers=only)
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig.from_pretrained(path))
    dense = tuple(i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "experts"))
    assert model_config_from_hf(path).dense_layers == dense


def test_the_expert_count_reads_from_either_spelling(config_dir):
    """transformers 5 writes `num_local_experts`, the released models and 4.x `num_experts`."""
    config = json.loads((config_dir / "config.json").read_text())
    assert config["num_local_experts"] == 8 and "num_experts" not in config
    write_config(config_dir, drop=("num_local_experts",), num_experts=8)
    assert model_config_from_hf(config_dir).n_experts == 8
    write_config(config_dir, num_local_experts=16)
    one_line_error(model_config_from_hf, config_dir, match="num_experts=8 and num_local_experts=16 disagree",
                   where=config_dir / "config.json")  # fmt: skip
    write_config(config_dir, drop=("num_local_experts",), num_experts=0)
    one_line_error(model_config_from_hf, config_dir, match="num_experts=0: every layer is dense",
                   where=config_dir / "config.json")  # fmt: skip
    write_config(config_dir, num_experts=8, num_experts_per_tok=9)
    one_line_error(model_config_from_hf, config_dir, match="num_experts_per_tok=9 is more than num_experts=8",
                   where=config_dir / "config.json")  # fmt: skip


@pytest.mark.parametrize("changes, where, message", [
    (dict(router_score="sigmoid"), "router_score", "routes by a softmax over every expert.*router_score='sigmoid'"),
    (dict(n_shared_experts=1, router_scale=2.5), "n_shared_experts", "n_shared_experts=1, router_scale=2.5$"),
    (dict(router_bias=True), "router_bias", "this model has router_bias=true"),
    (dict(family="qwen3"), "family", "Qwen3ForCausalLM has a dense feed-forward; this model has n_experts=8"),
])  # fmt: skip
def test_export_refuses_what_qwen3_moe_cannot_express(changes, where, message):
    cfg = resolve(ModelConfig(name="tiny-moe", **changes))
    one_line_error(hf_config, cfg, torch.float32, match=message, where=f"model.{where}")


def test_a_qwen3_moe_without_experts_is_refused_on_export():
    cfg = resolve(ModelConfig(name="qwen3-tiny", family="qwen3_moe"))
    one_line_error(hf_config, cfg, torch.float32, match="is a mixture of experts; this model sets no n_experts",
                   where="model.n_experts")  # fmt: skip


def test_a_recipe_must_have_the_imported_experts(saved):
    imported = model_config_from_hf(saved)
    check_against_recipe(imported, ModelConfig(name="from_hf", n_experts=8, dense_layers=[1]))
    one_line_error(check_against_recipe, imported, ModelConfig(name="from_hf", n_experts=16),
                   match="the recipe's model has n_experts=16, the Hugging Face model num_experts=8",
                   where="model.n_experts")  # fmt: skip
