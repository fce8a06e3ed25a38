"""The model families trainbook trains, and how each reads and writes Hugging Face's `config.json`.

A family is one set of architecture options of the one decoder (`model/llama.py`): what its
`ModelConfig` fields default to (`qkv_bias`, `qk_norm`, how `head_dim` is found) and what the
Hugging Face architecture of the same computation is called. Registry entries
(`model/registry.py`) name their family; import (`model/hf_import.py`) finds the family of a
`config.json` by its `architectures` / `model_type`, never by a model's name; export
(`model/hf.py`) writes the family's config. Parameter names are the same in every family
(`model/hf.py`'s one table): Qwen2 and Qwen3 name their projections, norms and biases as Llama does.

Qwen3-MoE is Qwen3's attention with a mixture of experts in the feed-forward (`model/moe.py`):
its config.json adds the expert keys (`moe_of_hf_config` reads them, `hf_fields` writes them) and
its class routes one way only: a softmax over every expert, the top-k optionally renormalised, no
shared experts, groups, scale or selection bias. DeepSeek-V3 routes as `model/moe.py` can, but
its attention is multi-head latent attention (MLA), which the decoder does not have: its
config.json is refused by name (`NOT_YET`).

Sources, transformers 5.x: `models/llama/modeling_llama.py`, `models/qwen2/modeling_qwen2.py`
(q/k/v biases hard-wired on, none on o_proj), `models/qwen3/modeling_qwen3.py` (`q_norm`/`k_norm`,
RMSNorm over head_dim of each head before RoPE; `attention_bias` puts a bias on all four
projections, o_proj included), `models/qwen3_moe/configuration_qwen3_moe.py` and
`modeling_qwen3_moe.py` (`Qwen3MoeDecoderLayer`: a layer routes unless it is in `mlp_only_layers`
or (i + 1) % `decoder_sparse_step` != 0; no head_dim default: hidden_size / heads).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainbook.errors import TrainbookError


@dataclass(frozen=True)
class Family:
    name: str
    """The value of `model.family`."""
    architecture: str
    """The Hugging Face class (config.json `architectures`)."""
    model_type: str
    """config.json `model_type`."""
    qkv_bias: bool
    """Biases on q/k/v (not o), as the family's released models have them."""
    qk_norm: bool
    """Per-head RMSNorm on q and k before RoPE."""
    head_dim: int | None
    """The family's fixed head_dim when config.json leaves it out (Qwen3Config: 128); None:
    hidden_size / num_attention_heads."""
    max_position_embeddings: int
    """transformers' default for a config.json that leaves it out."""
    source: str
    num_key_value_heads: int | None = None
    """transformers' default for a config.json that leaves `num_key_value_heads` out (Qwen2Config,
    Qwen3Config: 32, whatever the query heads); None: num_attention_heads, as LlamaConfig does.
    An explicit null is num_attention_heads in every family."""
    reads: frozenset[str] = frozenset()
    """The config.json switches the class reads that the decoder cannot follow when on:
    `attention_bias` (biases on all four projections), `mlp_bias`, `use_sliding_window`. Import
    refuses them on; export writes them off."""
    moe: bool = False
    """The class's feed-forward is a mixture of experts (Qwen3-MoE's config.json keys)."""

    def defaults(self, dim: int, n_heads: int) -> dict:
        """The option fields a config that does not set them gets."""
        return {"qkv_bias": self.qkv_bias, "qk_norm": self.qk_norm,
                "head_dim": self.head_dim if self.head_dim is not None else dim // n_heads}


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", "llama", qkv_bias=False, qk_norm=False, head_dim=None,
               max_position_embeddings=2048, reads=frozenset({"attention_bias", "mlp_bias"}),
               source="transformers/models/llama/modeling_llama.py"),
        Family("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True, qk_norm=False, head_dim=None,
               max_position_embeddings=32768, num_key_value_heads=32, reads=frozenset({"use_sliding_window"}),
               source="transformers/models/qwen2/modeling_qwen2.py (Qwen2 and Qwen2.5)"),
        Family("qwen3", "Qwen3ForCausalLM", "qwen3", qkv_bias=False, qk_norm=True, head_dim=128,
               max_position_embeddings=32768, num_key_value_heads=32,
               reads=frozenset({"attention_bias", "use_sliding_window"}),
               source="transformers/models/qwen3/modeling_qwen3.py"),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", qkv_bias=False, qk_norm=True, head_dim=None,
               max_position_embeddings=32768, num_key_value_heads=4,
               reads=frozenset({"attention_bias", "use_sliding_window"}), moe=True,
               source="transformers/models/qwen3_moe/modeling_qwen3_moe.py"),
    )
}
DEFAULT = "llama"
"""The family of a config that names none (every recipe and checkpoint from before families)."""
NOT_YET = {
    "DeepseekV3ForCausalLM": "DeepSeek-V3's multi-head latent attention (MLA) is not supported yet (its "
                             "routing is: router_score = \"sigmoid\", router_bias, router_groups)",
}
"""Architectures trainbook knows but cannot import yet -> why, in one line."""
_NOT_YET_TYPES = {"deepseek_v3": "DeepseekV3ForCausalLM"}


def family(name: str | None) -> Family:
    """The family called `name` (None: Llama)."""
    return FAMILIES[name or DEFAULT]


def with_options(model: dict) -> dict:
    """A saved `[model]` table (a resolved config.json of a run, a manifest's, a baseline's) with the
    family options filled where it was written before they existed: the values that model was
    built with (Llama: no biases, no q/k norms, head_dim = dim / n_heads). So an old run, checkpoint
    or baseline compares equal to the same model today. Tables without dim/n_heads are as given."""
    if not isinstance(model.get("dim"), int) or not isinstance(model.get("n_heads"), int) or model["n_heads"] < 1:
        return model
    fam = FAMILIES.get(model.get("family") or DEFAULT)
    if fam is None:
        return model
    filled = {"family": fam.name, **fam.defaults(model["dim"], model["n_heads"])}
    return {**model, **{k: v for k, v in filled.items() if model.get(k) is None}}


def config_as_built(config: dict) -> dict:
    """A saved config tree (run, manifest, baseline) with its `[model]` table as built (`with_options`)."""
    model = config.get("model")
    return {**config, "model": with_options(model)} if isinstance(model, dict) else config


def of_hf_config(config: dict, where: str) -> Family:
    """The family whose Hugging Face architecture `config` (a parsed config.json) names, or a
    one-line error naming the architecture and the ones trainbook imports."""
    archs = config.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    model_type = config.get("model_type")
    known = ", ".join(f.architecture for f in FAMILIES.values())
    if not archs and model_type is None:
        raise TrainbookError(f"names no architecture ('architectures', 'model_type'); trainbook imports {known}",
                             where=where)
    by_arch = {f.architecture: f for f in FAMILIES.values()}
    by_type = {f.model_type: f for f in FAMILIES.values()}
    for arch in [*archs, _NOT_YET_TYPES.get(model_type)]:
        if arch in NOT_YET:
            raise TrainbookError(f"{arch}: {NOT_YET[arch]}", where=where)
    found = {by_arch.get(a) for a in archs} if archs else {by_type.get(model_type)}
    if None in found or len(found) != 1:
        other = next((a for a in archs if a not in by_arch), None) or model_type
        raise TrainbookError(f"unsupported architecture '{other}' (trainbook imports {known})", where=where)
    fam = found.pop()
    if model_type not in (None, fam.model_type):
        raise TrainbookError(f"architectures says {fam.architecture} but model_type is '{model_type}'", where=where)
    return fam


def unsupported(fam: Family, config: dict) -> list[str]:
    """What in `config` this family's decoder would compute differently from transformers."""
    problems = []
    scaling = rope_scaling(config)
    if scaling is not None:
        problems.append(f"RoPE scaling '{scaling}' (trainbook's RoPE is unscaled)")
    # Only the keys the family's class reads: Qwen2 hard-wires its biases, and neither Qwen has an
    # MLP bias, so there those keys change nothing.
    if config.get("attention_bias") and "attention_bias" in fam.reads:
        problems.append("attention_bias=true (a bias on o_proj too; trainbook biases q/k/v only)")
    if config.get("mlp_bias") and "mlp_bias" in fam.reads:
        problems.append("mlp_bias=true (trainbook's SwiGLU has no biases)")
    if config.get("use_sliding_window"):
        problems.append("use_sliding_window=true (trainbook's attention is full causal; the released "
                        "Qwen models have it off)")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act='{act}' (trainbook's SwiGLU uses silu)")
    return problems


def rope_scaling(config: dict) -> str | None:
    """The RoPE scaling `config` asks for; None for plain RoPE. transformers 5 writes
    `rope_parameters: {rope_type, rope_theta, ...}`, 4.x wrote `rope_scaling` (null: none)."""
    params = _rope_parameters(config)
    if params is None:
        return None
    kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else None
    return None if kind == "default" else str(kind or params)


def rope_theta(config: dict) -> float:
    """RoPE's base: transformers 5's `rope_parameters.rope_theta`, else 4.x's top-level `rope_theta`
    (transformers 5 reads them in that order), else transformers' default 10000."""
    params = _rope_parameters(config)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return params["rope_theta"]
    return config["rope_theta"] if config.get("rope_theta") is not None else 10000.0


def _rope_parameters(config: dict):
    # The table transformers 5 takes its RoPE settings from: a non-empty `rope_scaling` replaces
    # `rope_parameters` (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict).
    return config.get("rope_scaling") or config.get("rope_parameters")


def hf_fields(fam: Family, cfg) -> dict:
    """The family-specific part of the `config.json` of resolved ModelConfig `cfg`, or a one-line
    error when the family's Hugging Face class cannot express one of cfg's options."""
    if cfg.qkv_bias != fam.qkv_bias or cfg.qk_norm != fam.qk_norm:
        raise TrainbookError(
            f"{fam.architecture} has qkv_bias={str(fam.qkv_bias).lower()}, qk_norm={str(fam.qk_norm).lower()}; "
            f"this model has qkv_bias={str(cfg.qkv_bias).lower()}, qk_norm={str(cfg.qk_norm).lower()}, "
            "which no Hugging Face class of its family computes",
            where="model.family",
        )
    if fam.moe and cfg.n_experts is None:
        raise TrainbookError(f"{fam.architecture} is a mixture of experts; this model sets no n_experts",
                             where="model.n_experts")
    if not fam.moe and cfg.n_experts is not None:
        raise TrainbookError(f"{fam.architecture} has a dense feed-forward; this model has n_experts={cfg.n_experts} "
                             "(family qwen3_moe writes Qwen3MoeForCausalLM)", where="model.family")
    out = {"architectures": [fam.architecture], "model_type": fam.model_type, "head_dim": cfg.head_dim}
    out |= {key: False for key in sorted(fam.reads)}
    if "use_sliding_window" in fam.reads:
        out |= {"sliding_window": None, "max_window_layers": cfg.n_layers}
    if fam.moe:
        out |= _qwen3_moe_fields(fam, cfg)
    return out


# The routing Qwen3MoeForCausalLM computes: a softmax over every expert, nothing else.
_QWEN3_MOE_ROUTER = {"router_score": "softmax", "n_shared_experts": 0, "router_bias": False, "router_groups": 1,
                     "router_topk_groups": 1, "router_scale": 1.0}  # fmt: skip


def _qwen3_moe_fields(fam: Family, cfg) -> dict:
    other = {k: getattr(cfg, k) for k, v in _QWEN3_MOE_ROUTER.items() if getattr(cfg, k) != v}
    if other:
        said = ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={str(v).lower()}" for k, v in other.items())
        raise TrainbookError(f"{fam.architecture} routes by a softmax over every expert, with no shared experts, "
                             f"groups, scale or selection bias; this model has {said}"
                             + (" (moe.balance = bias trains one)" if "router_bias" in other else ""),
                             where=f"model.{next(iter(other))}")
    return {"num_experts": cfg.n_experts, "num_experts_per_tok": cfg.n_experts_per_token,
            "moe_intermediate_size": cfg.expert_ffn_dim, "norm_topk_prob": cfg.router_norm_topk,
            "decoder_sparse_step": 1, "mlp_only_layers": list(cfg.dense_layers), "output_router_logits": False}


def moe_of_hf_config(config: dict, n_layers, where: str) -> dict:
    """The MoE fields of Qwen3-MoE `config` (a parsed config.json of `n_layers` layers), its keys
    left out taking Qwen3MoeConfig's defaults; a one-line error where it routes nowhere.

    transformers 5 writes the expert count as `num_local_experts` (an alias), the released models
    and transformers 4.x as `num_experts`. A layer is dense where Qwen3MoeDecoderLayer makes it so:
    in `mlp_only_layers` (entries beyond the layers name none, as there), or (i + 1) %
    `decoder_sparse_step` != 0.
    """
    given = {key for key in ("num_experts", "num_local_experts") if config.get(key) is not None}
    if len(given) == 2 and config["num_experts"] != config["num_local_experts"]:
        raise TrainbookError(f"num_experts={config['num_experts']} and num_local_experts={config['num_local_experts']} "
                             "disagree (transformers reads both as the one expert count)", where=where)
    experts = config[given.pop()] if given else 128
    if experts == 0:
        raise TrainbookError("num_experts=0: every layer is dense; trainbook imports a Qwen3-MoE with experts",
                             where=where)
    step = _or_default(config, "decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise TrainbookError(f"'decoder_sparse_step': not a positive integer (got {step!r})", where=where)
    only = config.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise TrainbookError(f"'mlp_only_layers': not a list of layer numbers (got {only!r})", where=where)
    layers = range(n_layers) if isinstance(n_layers, int) else range(0)  # a bad count: ModelConfig names it
    return {
        "n_experts": experts,
        "n_experts_per_token": _or_default(config, "num_experts_per_tok", 8),
        "expert_ffn_dim": _or_default(config, "moe_intermediate_size", 768),
        "router_norm_topk": _or_default(config, "norm_topk_prob", False),
        "dense_layers": tuple(i for i in layers if i in only or (i + 1) % step),
        **_QWEN3_MOE_ROUTER,
    }


def _or_default(config: dict, key: str, default):
    return default if config.get(key) is None else config[key]
