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
shared experts, groups, scale or selection bias. DeepSeek-V3 routes by sigmoid scores plus a
selection bias within groups, scaled, with shared experts, its first `first_k_dense_replace` layers
dense, and its attention is multi-head latent attention (`model/mla.py`, the `kv_lora_rank` fields).

Sources, transformers 5.x: `models/llama/modeling_llama.py`, `models/qwen2/modeling_qwen2.py`
(q/k/v biases hard-wired on, none on o_proj), `models/qwen3/modeling_qwen3.py` (`q_norm`/`k_norm`,
RMSNorm over head_dim of each head before RoPE; `attention_bias` puts a bias on all four
projections, o_proj included), `models/qwen3_moe/configuration_qwen3_moe.py` and
`modeling_qwen3_moe.py` (`Qwen3MoeDecoderLayer`: a layer routes unless it is in `mlp_only_layers`
or (i + 1) % `decoder_sparse_step` != 0; no head_dim default: hidden_size / heads),
`models/deepseek_v3/configuration_deepseek_v3.py` and `modeling_deepseek_v3.py` (`head_dim` is
`qk_rope_head_dim` whatever config.json says; `num_key_value_heads` only repeats keys already
expanded per head, so it must equal the heads; the multi-token-prediction layers
`num_nextn_predict_layers` describes are not built, their weights skipped on load).
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
    """The class's feed-forward is a mixture of experts (Qwen3-MoE's or DeepSeek-V3's config.json keys)."""
    mla: bool = False
    """The class's attention is multi-head latent attention (DeepSeek-V3's config.json keys)."""

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
        Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3", qkv_bias=False, qk_norm=False, head_dim=None,
               max_position_embeddings=4096, reads=frozenset({"attention_bias"}), moe=True, mla=True,
               source="transformers/models/deepseek_v3/modeling_deepseek_v3.py"),
    )
}
DEFAULT = "llama"
"""The family of a config that names none (every recipe and checkpoint from before families)."""


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
    if fam.mla and config.get("rope_interleave") is False:
        problems.append("rope_interleave=false (trainbook's MLA rotates interleaved channel pairs, as DeepSeek's "
                        "checkpoints are laid out)")
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
    if fam.mla and cfg.kv_lora_rank is None:
        raise TrainbookError(f"{fam.architecture}'s attention is multi-head latent attention; this model sets no "
                             "kv_lora_rank", where="model.kv_lora_rank")
    if not fam.mla and cfg.kv_lora_rank is not None:
        raise TrainbookError(f"{fam.architecture} has grouped-query attention; this model has multi-head latent "
                             f"attention (kv_lora_rank={cfg.kv_lora_rank}; family deepseek_v3 writes "
                             "DeepseekV3ForCausalLM)", where="model.family")
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
    out = {"architectures": [fam.architecture], "model_type": fam.model_type}
    if not fam.mla:  # DeepseekV3Config sets head_dim to qk_rope_head_dim itself
        out["head_dim"] = cfg.head_dim
    out |= {key: False for key in sorted(fam.reads)}
    if "use_sliding_window" in fam.reads:
        out |= {"sliding_window": None, "max_window_layers": cfg.n_layers}
    if fam.mla:
        out |= _deepseek_v3_fields(fam, cfg)
    elif fam.moe:
        out |= _qwen3_moe_fields(fam, cfg)
    return out


# The routing Qwen3MoeForCausalLM computes: a softmax over every expert, nothing else.
_QWEN3_MOE_ROUTER = {"router_score": "softmax", "n_shared_experts": 0, "router_bias": False, "router_groups": 1,
                     "router_topk_groups": 1, "router_scale": 1.0}  # fmt: skip


def _qwen3_moe_fields(fam: Family, cfg) -> dict:
    other = {k: getattr(cfg, k) for k, v in _QWEN3_MOE_ROUTER.items() if getattr(cfg, k) != v}
    if other:
        said = _said(other)
        raise TrainbookError(f"{fam.architecture} routes by a softmax over every expert, with no shared experts, "
                             f"groups, scale or selection bias; this model has {said}"
                             + (" (moe.balance = bias trains one)" if "router_bias" in other else ""),
                             where=f"model.{next(iter(other))}")
    return {"num_experts": cfg.n_experts, "num_experts_per_tok": cfg.n_experts_per_token,
            "moe_intermediate_size": cfg.expert_ffn_dim, "norm_topk_prob": cfg.router_norm_topk,
            "decoder_sparse_step": 1, "mlp_only_layers": list(cfg.dense_layers), "output_router_logits": False}


# The routing DeepseekV3ForCausalLM computes: sigmoid scores, a selection bias, shared experts.
_DEEPSEEK_V3_ROUTER = {"router_score": "sigmoid", "router_bias": True}
# ModelConfig field -> (DeepseekV3Config key, its default); q_lora_rank's null is 0 here.
_DEEPSEEK_V3_KEYS = {
    "n_experts": ("n_routed_experts", 256), "n_experts_per_token": ("num_experts_per_tok", 8),
    "expert_ffn_dim": ("moe_intermediate_size", 2048), "n_shared_experts": ("n_shared_experts", 1),
    "router_scale": ("routed_scaling_factor", 2.5), "router_groups": ("n_group", 8),
    "router_topk_groups": ("topk_group", 4), "router_norm_topk": ("norm_topk_prob", True),
    "kv_lora_rank": ("kv_lora_rank", 512), "q_lora_rank": ("q_lora_rank", 1536),
    "qk_nope_head_dim": ("qk_nope_head_dim", 128), "qk_rope_head_dim": ("qk_rope_head_dim", 64),
    "v_head_dim": ("v_head_dim", 128),
}  # fmt: skip


def _deepseek_v3_fields(fam: Family, cfg) -> dict:
    other = {k: getattr(cfg, k) for k, v in _DEEPSEEK_V3_ROUTER.items() if getattr(cfg, k) != v}
    if cfg.n_shared_experts == 0:
        other["n_shared_experts"] = 0
    first_k = len(cfg.dense_layers)
    if tuple(cfg.dense_layers) != tuple(range(first_k)):
        other["dense_layers"] = list(cfg.dense_layers)
    if other:
        said = _said(other)
        raise TrainbookError(f"{fam.architecture} routes by sigmoid scores with a selection bias, through at least one "
                             f"shared expert, its dense layers the first ones; this model has {said}",
                             where=f"model.{next(iter(other))}")
    out = {key: getattr(cfg, field) for field, (key, _) in _DEEPSEEK_V3_KEYS.items()}
    return out | {"q_lora_rank": cfg.q_lora_rank or None, "first_k_dense_replace": first_k, "rope_interleave": True,
                  "num_nextn_predict_layers": 0, "output_router_logits": False}


def moe_of_hf_config(fam: Family, config: dict, n_layers, where: str) -> dict:
    """The MoE fields (and DeepSeek-V3's MLA fields) of `config` (a parsed config.json of
    `n_layers` layers of family `fam`), its keys left out taking the family's config class's
    defaults; a one-line error where it routes nowhere."""
    if fam.mla:
        return _deepseek_v3_of_hf_config(config, n_layers, where)
    return _qwen3_moe_of_hf_config(config, n_layers, where)


def _deepseek_v3_of_hf_config(config: dict, n_layers, where: str) -> dict:
    """DeepseekV3Config's keys: a layer routes from `first_k_dense_replace` on; `q_lora_rank: null`
    projects queries directly (0 here); `n_routed_experts` also spelt `num_local_experts`."""
    values = {field: _or_default(config, key, default) for field, (key, default) in _DEEPSEEK_V3_KEYS.items()}
    if config.get("n_routed_experts") is None and config.get("num_local_experts") is not None:
        values["n_experts"] = config["num_local_experts"]
    if "q_lora_rank" in config and config["q_lora_rank"] is None:
        values["q_lora_rank"] = 0
    if values["n_shared_experts"] == 0:
        raise TrainbookError("n_shared_experts=0: DeepseekV3ForCausalLM then builds an empty shared expert, which "
                             "trainbook does not", where=where)
    first_k = _or_default(config, "first_k_dense_replace", 3)
    if not isinstance(first_k, int) or isinstance(first_k, bool) or first_k < 0:
        raise TrainbookError(f"'first_k_dense_replace': not a layer count (got {first_k!r})", where=where)
    layers = range(n_layers) if isinstance(n_layers, int) else range(0)  # a bad count: ModelConfig names it
    return values | _DEEPSEEK_V3_ROUTER | {"dense_layers": tuple(i for i in layers if i < first_k)}


def _qwen3_moe_of_hf_config(config: dict, n_layers, where: str) -> dict:
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


def _said(values: dict) -> str:
    """`key=value, ...` as a recipe writes them: strings and lists quoted, booleans lower-case."""
    return ", ".join(f"{k}={v!r}" if isinstance(v, (str, list)) else f"{k}={str(v).lower()}" for k, v in values.items())


def _or_default(config: dict, key: str, default):
    return default if config.get(key) is None else config[key]
