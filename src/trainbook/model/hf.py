"""Trainbook's decoder <-> Hugging Face `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
`Qwen3MoeForCausalLM`, `DeepseekV3ForCausalLM`: names, `config.json`, weights.

One table maps every parameter name, the same in every family (Qwen2's q/k/v biases and Qwen3's
q/k norms sit where Llama's projections do, an MoE layer's router and shared experts where the
dense SwiGLU does, latent attention's projections where the others' do); `to_hf_name` and
`from_hf_name` read it in either direction. The family
(`model/families.py`) decides the rest of config.json.
No tensor needs changing on the way: trainbook's RoPE already uses HF's half-split ("rotate_half")
channel layout, so wq/wk are not permuted (latent attention rotates DeepSeek's interleaved pairs
as transformers does), and both store `nn.Linear` weights as (out, in).

Two structural differences:
- tied embeddings: trainbook's state dict names the shared matrix twice (`tok_embeddings.weight`,
  `output.weight`), HF's once (`model.embed_tokens.weight`, no `lm_head.weight`,
  `tie_word_embeddings: true`). `to_hf_state_dict` drops the second name.
- experts: trainbook stacks a layer's experts into one tensor per projection
  (`layers.<i>.feed_forward.experts.w1`, row e expert e), HF's files hold one tensor per expert
  (`model.layers.<i>.mlp.experts.<e>.gate_proj.weight`), which is what transformers 5's
  `save_pretrained` writes and `from_pretrained` reads though its model fuses them in memory
  (`experts.gate_up_proj`). `expert_names` gives the rows' names.

Import (`model.init_from = "hf:PATH"`) reads the same table: see `model/hf_import.py`.
"""

from __future__ import annotations

import re

import torch

from trainbook.config.model import ModelConfig
from trainbook.model import families
from trainbook.model.registry import is_resolved, resolve

# trainbook name -> HF name, for the parameters outside the blocks.
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# trainbook `layers.<i>.` suffix -> HF `model.layers.<i>.` suffix, for each block's parameters.
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",  # qkv_bias (Qwen2)
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",  # qk_norm (Qwen3)
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",  # multi-head latent attention (DeepSeek-V3)
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",  # an MoE layer (Qwen3-MoE, DeepSeek-V3)
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",  # DeepSeek-V3
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",  # DeepSeek-V3
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
}
# trainbook `layers.<i>.` suffix of a stacked expert weight -> HF suffix of expert e's row.
_EXPERTS = {
    "feed_forward.experts.w1": "mlp.experts.{e}.gate_proj.weight",
    "feed_forward.experts.w3": "mlp.experts.{e}.up_proj.weight",
    "feed_forward.experts.w2": "mlp.experts.{e}.down_proj.weight",
}
_TOP_BACK = {hf: ours for ours, hf in _TOP.items()}
_BLOCK_BACK = {hf: ours for ours, hf in _BLOCK.items()}

_OURS_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")

# torch dtype -> the name `config.json` gives it (`torch_dtype`).
_HF_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def to_hf_name(name: str) -> str:
    """The Hugging Face name of trainbook parameter `name`; KeyError if it has none (a stacked
    expert weight has one per expert: `expert_names`)."""
    return _rename(name, _TOP, _BLOCK, _OURS_BLOCK, "model.layers.")


def from_hf_name(name: str) -> str:
    """The trainbook name of Hugging Face parameter `name`; KeyError if it has none
    (e.g. `rotary_emb.inv_freq`, which old HF checkpoints saved and trainbook derives, or one
    expert's weight, a row of a trainbook tensor: `expert_names`)."""
    return _rename(name, _TOP_BACK, _BLOCK_BACK, _HF_BLOCK, "layers.")


def expert_names(name: str, n_experts: int) -> list[str] | None:
    """The Hugging Face names of the rows of trainbook's stacked expert weight `name` (row e ->
    element e), or None when `name` is not one."""
    m = _OURS_BLOCK.fullmatch(name)
    if m is None or m.group(2) not in _EXPERTS:
        return None
    return [f"model.layers.{m.group(1)}.{_EXPERTS[m.group(2)].format(e=e)}" for e in range(n_experts)]


def _rename(name: str, top: dict, block: dict, block_re: re.Pattern, block_prefix: str) -> str:
    if name in top:
        return top[name]
    m = block_re.fullmatch(name)
    if m is None or m.group(2) not in block:
        raise KeyError(f"no parameter maps to {name!r}")
    return f"{block_prefix}{m.group(1)}.{block[m.group(2)]}"


def to_hf_state_dict(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """A trainbook model state dict under HF names; `output.weight` left out when `tied` (HF
    re-ties `lm_head` to the embedding from `tie_word_embeddings`), stacked expert weights split
    into one tensor per expert (copies: safetensors stores no two views of one storage)."""
    out = {}
    for k, v in state.items():
        if tied and k == "output.weight":
            continue
        rows = expert_names(k, v.shape[0])
        if rows is None:
            out[to_hf_name(k)] = v
        else:
            out |= {hf: v[e].clone() for e, hf in enumerate(rows)}
    return out


def hf_config(
    cfg: ModelConfig,
    dtype: torch.dtype,
    *,
    bos_id: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
) -> dict:
    """The `config.json` of the Hugging Face model of `cfg`'s family equal to trainbook model `cfg`,
    weights in `dtype`; a one-line error when that class cannot express one of cfg's options.

    Written in the long-standing flat form (top-level `rope_theta`, `torch_dtype`) that
    transformers 4.x and 5.x, vLLM and llama.cpp's converter all read. Special token ids are
    written even when unknown (null): left out, transformers would assume bos=1, eos=2.
    """
    cfg = cfg if is_resolved(cfg) else resolve(cfg)
    return {
        **families.hf_fields(families.family(cfg.family), cfg),
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,  # trainbook's RoPE is unscaled (see model.registry)
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "torch_dtype": _HF_DTYPE[dtype],
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }
