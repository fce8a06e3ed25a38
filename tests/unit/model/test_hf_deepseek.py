"""DeepSeek-V3 against transformers' own `DeepseekV3ForCausalLM`, built offline on a tiny config that is
nobody's default: multi-head latent attention with a 24-wide key/value latent, 16 + 8 query/key
channels a head (8 rotated) and values 20 wide (padded to 24 for the attention kernel) against a 64-wide residual, queries through a
40-wide latent or projected directly; 8 experts of 24 hidden units in 4 groups, 2 per token from the
best 2 groups, a shared expert, a routed scale of 2.5, the first of three layers dense; RoPE base
1e6. Every tensor is random before it is saved, the routers' selection bias included (transformers
starts it at 0, where a dropped bias would not show). Then: import's logits against transformers'
and gradients (bit for bit, and within 1e-6, once the known roundings are matched); export loaded
back by transformers; import -> export -> import bit for bit; the multi-token-prediction layer's
weights skipped; the config.json and export refusals. Latent attention's KV cache and document
masks: test_sampler.py and test_doc_masking.py; plan's activation estimate: tests/dist/test_plan.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from tests.unit.model.test_hf_families import (
    assert_round_trip, export_run, import_hf, logits, save_random, tokens, write_config,
)
from tests.unit.model.test_hf_import import one_line_error
from tests.unit.model.test_moe import ContiguousSilu
from trainbook.config.model import ModelConfig
from trainbook.model import resolve
from trainbook.model.hf import hf_config, to_hf_name
from trainbook.model.hf_import import check_against_recipe, model_config_from_hf

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1, n_group=4,
             topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, rope_theta=1e6,
             max_position_embeddings=64, rms_norm_eps=1e-6, num_mtp_layers=0)  # fmt: skip
CASES = pytest.mark.parametrize("q_rank, norm", [(40, True), (None, False)], ids=["q-latent-renormalised", "q-direct-raw"])
# Import's logits differ from transformers' by this much at most (fp32, |logits| up to ~4, so
# within 1e-6 of their scale): RoPE's tables, silu's rounding of a strided tensor and the attention
# kernel (test_imported_logits_match_transformers).
ATOL = 4e-6


def save_hf(root: Path, q_rank: int | None, norm: bool, **changes) -> tuple[Path, torch.nn.Module]:
    """A random tiny DeepSeek-V3 saved by transformers into root/hf; returns (dir, model)."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**SHAPE | changes, q_lora_rank=q_rank, norm_topk_prob=norm)
    hf = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, bias in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias.copy_(0.1 * torch.randn_like(bias))
    return save_random(root, hf)


# ---- parity --------------------------------------------------------------------------------------


@CASES
def test_imported_logits_match_transformers(tmp_path, q_rank, norm, one_thread):
    path, hf = save_hf(tmp_path, q_rank, norm)
    files = load_file(path / "model.safetensors")
    # What save_pretrained writes: MLA's projections and norms, the router's bias, one tensor per expert.
    latent = {"self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"}
    assert latent <= {k.removeprefix("model.layers.0.") for k in files} if q_rank else "model.layers.0.self_attn.q_proj.weight" in files
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in files and "model.layers.0.mlp.gate_proj.weight" in files
    assert files["model.layers.1.mlp.gate.e_score_correction_bias"].std() > 0.05
    cfg = model_config_from_hf(path)
    assert (cfg.family, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
            cfg.v_head_dim, cfg.head_dim, cfg.n_kv_heads) == ("deepseek_v3", 24, q_rank or 0, 16, 8, 20, 8, 4)
    assert (cfg.n_experts, cfg.n_experts_per_token, cfg.n_shared_experts, cfg.router_score, cfg.router_bias,
            cfg.router_groups, cfg.router_topk_groups, cfg.router_scale, cfg.router_norm_topk,
            cfg.dense_layers) == (8, 2, 1, "sigmoid", True, 4, 2, 2.5, norm, (0,))  # fmt: skip
    model, x = import_hf(path), tokens()
    theirs = logits(hf, x)
    torch.testing.assert_close(logits(model, x), theirs, rtol=0, atol=ATOL)
    # Not bit for bit, for three reasons, each a rounding of one op: RoPE's inverse frequencies
    # (test_hf_families says why), silu on transformers' strided half of gate_up
    # (test_moe.test_blocks_match_transformers), and the attention kernel (`padded_attention`).
    # With transformers' cos/sin tables in the model, its silu on a contiguous copy and its attention
    # given padded values, the logits are equal bit for bit: the latents and their norms, the
    # interleaved RoPE on the shared key, the expanded keys and values, routing with the bias and
    # groups, the shared expert.
    positions = torch.arange(cfg.max_seq_len)[None]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)  # (1, T, qk_rope_head_dim)
    model.rope_cos.copy_(cos[0, :, : cfg.head_dim // 2])
    model.rope_sin.copy_(sin[0, :, : cfg.head_dim // 2])
    for layer in hf.model.layers[1:]:
        layer.mlp.experts.act_fn = ContiguousSilu()
    hf.set_attn_implementation(PADDED)
    assert torch.equal(logits(model, x), logits(hf, x))


def test_gradients_match_transformers(tmp_path, one_thread):
    """One loss, backward through both, with the three roundings matched as above: the loss is
    equal bit for bit, and so is every gradient up to the last layer's routed experts (the output
    head, the final norm, the last router and shared expert); from there on transformers
    differentiates through its fused gate_up_proj and its own weighting of the expert rows, which
    round differently, and every gradient is within 1e-6 of its largest element."""
    path, hf = save_hf(tmp_path, 40, True)
    model = import_hf(path).train()
    positions = torch.arange(model.cfg.max_seq_len)[None]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    with torch.no_grad():
        model.rope_cos.copy_(cos[0, :, : model.cfg.head_dim // 2])
        model.rope_sin.copy_(sin[0, :, : model.cfg.head_dim // 2])
    for layer in hf.model.layers[1:]:
        layer.mlp.experts.act_fn = ContiguousSilu()
    hf.set_attn_implementation(PADDED)
    hf.train()
    x = tokens()
    ours = model(x[:, :-1], targets=x[:, 1:])
    theirs = F.cross_entropy(hf(x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten())
    assert torch.equal(ours, theirs)
    ours.backward()
    theirs.backward()
    hf_params, hidden = dict(hf.named_parameters()), model.cfg.expert_ffn_dim
    for name, param in model.named_parameters():
        if ".experts." in name:  # transformers fuses w1 and w3 as gate_up_proj (E, 2 hidden, dim)
            layer, w = name.split(".")[1], name.rsplit(".", 1)[1]
            fused = hf_params[f"model.layers.{layer}.mlp.experts.gate_up_proj"].grad
            expected = {"w1": fused[:, :hidden], "w3": fused[:, hidden:],
                        "w2": hf_params[f"model.layers.{layer}.mlp.experts.down_proj"].grad}[w]  # fmt: skip
        else:
            expected = hf_params[to_hf_name(name)].grad
        if name.startswith(("output.", "norm.", "layers.2.feed_forward.router.", "layers.2.feed_forward.shared.")):
            assert torch.equal(param.grad, expected), name
        assert (param.grad - expected).abs().max() <= 1e-6 * expected.abs().max(), name


def padded_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention as trainbook's latent attention computes it: the values padded with
    zeros to the query width, so torch's fused kernel runs (transformers' `sdpa` hands torch values
    of their own width, which sends it down the math path: another rounding, the one difference
    left). Causal, no padding tokens: the tests' batches."""
    width, v_dim = query.shape[-1], value.shape[-1]
    out = F.scaled_dot_product_attention(query, key, F.pad(value, (0, width - v_dim)), is_causal=True)
    return out[..., :v_dim].transpose(1, 2).contiguous(), None


PADDED = "trainbook_padded_sdpa"
transformers.AttentionInterface.register(PADDED, padded_attention)


@CASES
def test_export_loads_into_transformers_and_reimports_bit_for_bit(tmp_path, q_rank, norm):
    path, hf = save_hf(tmp_path, q_rank, norm)
    model = import_hf(path)
    out = export_run(tmp_path, model.cfg, model.state_dict())
    config = json.loads((out / "config.json").read_text())
    assert (config["q_lora_rank"], config["first_k_dense_replace"], config["n_group"]) == (q_rank, 1, 4)
    assert (config["rope_interleave"], config["num_nextn_predict_layers"], config["rope_scaling"]) == (True, 0, None)
    assert_round_trip(path, out, model, hf, transformers.DeepseekV3ForCausalLM)


def test_the_multi_token_prediction_layers_weights_are_skipped(tmp_path):
    """Released checkpoints hold `num_nextn_predict_layers` more layers after the last block, which
    transformers does not build; a layer beyond those is still an unknown tensor."""
    path, _ = save_hf(tmp_path, 40, True)
    expected = logits(import_hf(path), tokens())
    files = load_file(path / "model.safetensors")
    mtp = {k.replace("layers.2.", "layers.3."): t.clone() for k, t in files.items() if k.startswith("model.layers.2.")}
    save_file(files | mtp | {"model.layers.3.eh_proj.weight": torch.zeros(64, 128)}, path / "model.safetensors")
    one_line_error(import_hf, path, match="the weights have 'model.layers.3.eh_proj.weight'", where=path)
    write_config(path, num_nextn_predict_layers=1)
    assert torch.equal(logits(import_hf(path), tokens()), expected)
    save_file(files | {"model.layers.4.eh_proj.weight": torch.zeros(1)}, path / "model.safetensors")
    one_line_error(import_hf, path, match="the weights have 'model.layers.4.eh_proj.weight'", where=path)


# ---- config.json ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return save_hf(tmp_path_factory.mktemp("deepseek_v3"), 40, True)[0]


@pytest.fixture
def config_dir(saved, tmp_path) -> Path:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text((saved / "config.json").read_text())
    return tmp_path / "hf"


@pytest.mark.parametrize("changes, message", [
    (dict(rope_interleave=False), "rope_interleave=false \\(trainbook's MLA rotates interleaved channel pairs"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0}), "RoPE scaling 'yarn'"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 differs from num_attention_heads=4"),
    (dict(n_shared_experts=0), "n_shared_experts=0: DeepseekV3ForCausalLM then builds an empty shared expert"),
    (dict(first_k_dense_replace=-1), "'first_k_dense_replace': not a layer count"),
    (dict(attention_bias=True), "attention_bias=true"),
])  # fmt: skip
def test_what_trainbook_would_compute_differently_is_refused_in_one_line(config_dir, changes, message):
    write_config(config_dir, **changes)
    one_line_error(model_config_from_hf, config_dir, match=message, where=config_dir / "config.json")


def test_left_out_keys_get_transformers_defaults(config_dir):
    """DeepseekV3Config's defaults (q_lora_rank 1536, ..., the first 3 layers dense), as transformers
    builds them; an explicit null q_lora_rank projects the queries directly."""
    keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
            "topk_group", "first_k_dense_replace", "routed_scaling_factor", "n_shared_experts")
    path = write_config(config_dir, drop=keys, num_hidden_layers=4, n_routed_experts=16)
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config.from_pretrained(path))
    cfg = model_config_from_hf(path)
    attn = hf.model.layers[0].self_attn
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        attn.q_lora_rank, attn.kv_lora_rank, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim)
    assert cfg.dense_layers == tuple(i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "experts"))
    gate = hf.model.layers[3].mlp.gate
    assert (cfg.router_groups, cfg.router_topk_groups, cfg.router_scale) == (gate.num_group, gate.topk_group,
                                                                              gate.routed_scaling_factor)
    assert cfg.n_shared_experts * cfg.expert_ffn_dim == hf.model.layers[3].mlp.shared_experts.intermediate_size
    assert model_config_from_hf(write_config(config_dir, q_lora_rank=None)).q_lora_rank == 0


@pytest.mark.parametrize("changes, where, message", [
    (dict(router_bias=False), "router_bias", "routes by sigmoid scores with a selection bias.*router_bias=false$"),
    (dict(n_shared_experts=0), "n_shared_experts", "this model has n_shared_experts=0$"),
    (dict(dense_layers=[0, 2]), "dense_layers", "this model has dense_layers=\\[0, 2\\]$"),
    (dict(family="qwen3_moe", router_score="softmax", router_bias=False, router_groups=1, router_topk_groups=1,
          router_scale=1.0, n_shared_experts=0, qk_norm=False), "family",
     "Qwen3MoeForCausalLM has grouped-query attention; this model has multi-head latent attention"),
])  # fmt: skip
def test_export_refuses_what_deepseek_v3_cannot_express(changes, where, message):
    cfg = resolve(ModelConfig(name="deepseek-v3-tiny", **changes))
    one_line_error(hf_config, cfg, torch.float32, match=message, where=f"model.{where}")


def test_a_deepseek_v3_without_latent_attention_is_refused_on_export():
    cfg = resolve(ModelConfig(name="tiny-moe", family="deepseek_v3", router_score="sigmoid", router_bias=True,
                              n_shared_experts=1))  # fmt: skip
    one_line_error(hf_config, cfg, torch.float32, match="attention is multi-head latent attention; this model sets "
                   "no kv_lora_rank", where="model.kv_lora_rank")  # fmt: skip


def test_a_recipe_must_have_the_imported_latents(saved):
    imported = model_config_from_hf(saved)
    check_against_recipe(imported, ModelConfig(name="from_hf", kv_lora_rank=24, n_experts=8))
    one_line_error(check_against_recipe, imported, ModelConfig(name="from_hf", kv_lora_rank=32),
                   match="the recipe's model has kv_lora_rank=32, the Hugging Face model kv_lora_rank=24",
                   where="model.kv_lora_rank")  # fmt: skip
