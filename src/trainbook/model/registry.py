"""Named model sizes, and `resolve`: a registry name plus overrides -> a complete, valid config.

Each entry is a plain table of the architecture fields of `ModelConfig`, citing where its numbers
come from; it names its `family` (`model/families.py`) and may leave that family's options
(`head_dim`, `qkv_bias`, `qk_norm`) to its defaults. A mixture of experts sets `n_experts`,
`n_experts_per_token` and `expert_ffn_dim` and may leave the other MoE fields to `MOE_DEFAULTS`;
a dense entry sets none of them. A recipe names an entry (`model.name = "tiny"`) and may override
any field (`model.n_layers = 2`); `resolve` merges the two and checks the shapes fit together,
once, so the model code can trust its config.

Llama 3.1 and 3.2 checkpoints stretch RoPE to 128K tokens with `rope_scaling` ("llama3" frequency
scaling). That is out of scope here: RoPE is unscaled, so the Llama entries cover the 8192-token
context Llama 3 was pre-trained at (`max_seq_len = 8192`), not the advertised 131072.
"""

from __future__ import annotations

import difflib

from trainbook.config.model import ModelConfig
from trainbook.errors import TrainbookError
from trainbook.model.families import family

# The architecture fields every entry must define (everything in ModelConfig but the name).
# Architecture fields (what a registry entry sets); `init_from` and `resize_init` say how to start.
ARCH_FIELDS = tuple(f for f in ModelConfig.model_fields if f not in ("name", "init_from", "resize_init"))
# The fields an entry (or a config.json) may leave to its family's defaults.
OPTIONS = ("family", "head_dim", "qkv_bias", "qk_norm")
# The mixture-of-experts fields: all unset on a dense model (`model/moe.py`).
MOE_FIELDS = ("n_experts", "n_experts_per_token", "expert_ffn_dim", "n_shared_experts", "router_score",
              "router_norm_topk", "router_bias", "router_groups", "router_topk_groups", "router_scale",
              "dense_layers")  # fmt: skip
# What an MoE model that does not set them gets: Qwen3-MoE's routing (a softmax over every expert,
# the top-k renormalised as its released models do), no shared experts, every layer routed.
MOE_DEFAULTS = {"n_shared_experts": 0, "router_score": "softmax", "router_norm_topk": True, "router_bias": False,
                "router_groups": 1, "router_topk_groups": 1, "router_scale": 1.0, "dense_layers": ()}  # fmt: skip
_MOE_REQUIRED = ("n_experts_per_token", "expert_ffn_dim")
# The multi-head latent attention fields (`model/mla.py`): all unset on grouped-query attention,
# all set once `kv_lora_rank` is.
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
FROM_HF = "from_hf"

# fmt: off
REGISTRY: dict[str, dict] = {
    # CPU-sized: a few M parameters, trains on a laptop in minutes. n_kv_heads < n_heads so the
    # default recipe exercises grouped-query attention. Shapes are ours (no upstream checkpoint).
    "tiny": dict(
        source="trainbook (original; Llama-3 architecture scaled down)",
        family="llama",
        dim=192, n_layers=4, n_heads=6, n_kv_heads=2, ffn_dim=512, vocab_size=2048,
        norm_eps=1e-5, rope_theta=10000.0, max_seq_len=1024, tie_embeddings=True, init_std=0.02,
    ),
    # ~20M parameters: the mid-size CPU recipe (recipes/bible-shakespeare-20m.toml). Ours too.
    "small": dict(
        source="trainbook (original; Llama-3 architecture, ~20M parameters)",
        family="llama",
        dim=384, n_layers=12, n_heads=6, n_kv_heads=2, ffn_dim=1024, vocab_size=8192,
        norm_eps=1e-5, rope_theta=10000.0, max_seq_len=1024, tie_embeddings=True, init_std=0.02,
    ),
    # Smallest shape that still has GQA, more than one block and an even head_dim: unit tests.
    "debug": dict(
        source="trainbook (original; unit tests)",
        family="llama",
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512,
        norm_eps=1e-5, rope_theta=10000.0, max_seq_len=256, tie_embeddings=False, init_std=0.02,
    ),
    # Llama 3.1 shapes; also Table 3 of "The Llama 3 Herd of Models" (arXiv:2407.21783).
    "llama3-8b": dict(
        source="https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
        family="llama",
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
        norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=False, init_std=0.02,
    ),
    "llama3-70b": dict(
        source="https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json",
        family="llama",
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256,
        norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=False, init_std=0.02,
    ),
    "llama3-405b": dict(
        source="https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json",
        family="llama",
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab_size=128256,
        norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=False, init_std=0.02,
    ),
    # Llama 3.2 text models: tied embeddings (the 128K-row matrix is a large share of them).
    "llama3.2-1b": dict(
        source="https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json",
        family="llama",
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
        norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=True, init_std=0.02,
    ),
    "llama3.2-3b": dict(
        source="https://huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json",
        family="llama",
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
        norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=True, init_std=0.02,
    ),
    # Qwen2.5 (family qwen2: q/k/v biases). Base models; theta 1e6, eps 1e-6.
    "qwen2.5-0.5b": dict(
        source="https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json",
        family="qwen2",
        dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768, tie_embeddings=True, init_std=0.02,
    ),
    "qwen2.5-1.5b": dict(
        source="https://huggingface.co/Qwen/Qwen2.5-1.5B/blob/main/config.json",
        family="qwen2",
        dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=131072, tie_embeddings=True, init_std=0.02,
    ),
    "qwen2.5-7b": dict(
        source="https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json",
        family="qwen2",
        dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944, vocab_size=152064,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=131072, tie_embeddings=False, init_std=0.02,
    ),
    # Qwen3 dense (family qwen3: q/k norms, head_dim 128 at every size, so 0.6B's 16 x 128 = 2048
    # heads' width is twice its dim of 1024).
    "qwen3-0.6b": dict(
        source="https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json",
        family="qwen3",
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, tie_embeddings=True, init_std=0.02,
    ),
    "qwen3-1.7b": dict(
        source="https://huggingface.co/Qwen/Qwen3-1.7B/blob/main/config.json",
        family="qwen3",
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=6144, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, tie_embeddings=True, init_std=0.02,
    ),
    "qwen3-4b": dict(
        source="https://huggingface.co/Qwen/Qwen3-4B/blob/main/config.json",
        family="qwen3",
        dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=9728, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, tie_embeddings=True, init_std=0.02,
    ),
    "qwen3-8b": dict(
        source="https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json",
        family="qwen3",
        dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, tie_embeddings=False, init_std=0.02,
    ),
    "qwen3-32b": dict(
        source="https://huggingface.co/Qwen/Qwen3-32B/blob/main/config.json",
        family="qwen3",
        dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=25600, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, tie_embeddings=False, init_std=0.02,
    ),
    # A CPU-sized Qwen3 (ours): GQA, q/k norms, and a head_dim (32) that is not dim / n_heads (16).
    "qwen3-tiny": dict(
        source="trainbook (original; Qwen3 architecture scaled down)",
        family="qwen3",
        dim=128, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, ffn_dim=384, vocab_size=2048,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=1024, tie_embeddings=True, init_std=0.02,
    ),
    # Qwen3-MoE (family qwen3_moe: Qwen3's attention, a routed feed-forward). 128 experts of 768,
    # 8 per token: 30.5B parameters, 3.3B of them active per token (the model card's figures).
    "qwen3-30b-a3b": dict(
        source="https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json",
        family="qwen3_moe",
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, tie_embeddings=False, init_std=0.02,
        n_experts=128, n_experts_per_token=8, expert_ffn_dim=768, router_norm_topk=True, dense_layers=(),
    ),
    # A CPU-sized Qwen3-MoE (ours, 1.9M parameters, 1.0M active per token): 8 experts of 128, 2 per token,
    # and layer 0 dense (as DeepSeek-V3 keeps its first layers), so both feed-forwards are trained.
    "tiny-moe": dict(
        source="trainbook (original; Qwen3-MoE architecture scaled down)",
        family="qwen3_moe",
        dim=128, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, ffn_dim=384, vocab_size=2048,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=1024, tie_embeddings=True, init_std=0.02,
        n_experts=8, n_experts_per_token=2, expert_ffn_dim=128, router_norm_topk=True, dense_layers=(0,),
    ),
    # DeepSeek-V3 (family deepseek_v3: multi-head latent attention, model/mla.py; 256 routed experts of
    # 2048 chosen 8 at a time within 4 of 8 groups by sigmoid scores plus a selection bias, a shared
    # expert, the first 3 layers dense). Its config.json stretches RoPE to 163840 tokens with YaRN
    # (factor 40 over 4096); RoPE is unscaled here, so the entry is the model at the 4096-token
    # context it was pre-trained at, which Hugging Face loads with `rope_scaling: null`. Without the
    # multi-token-prediction layer (num_nextn_predict_layers), which transformers does not build.
    "deepseek-v3": dict(
        source="https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json",
        family="deepseek_v3",
        dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_dim=18432, vocab_size=129280,
        norm_eps=1e-6, rope_theta=10000.0, max_seq_len=4096, tie_embeddings=False, init_std=0.02,
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_experts=256, n_experts_per_token=8, expert_ffn_dim=2048, n_shared_experts=1, router_score="sigmoid",
        router_norm_topk=True, router_bias=True, router_groups=8, router_topk_groups=4, router_scale=2.5,
        dense_layers=(0, 1, 2),
    ),
    # A CPU-sized DeepSeek-V3 (ours): MLA with both latents, 8 experts in 4 groups, 2 per token from
    # the best 2 groups, a shared expert, layer 0 dense.
    "deepseek-v3-tiny": dict(
        source="trainbook (original; DeepSeek-V3 architecture scaled down)",
        family="deepseek_v3",
        dim=128, n_layers=4, n_heads=8, n_kv_heads=8, ffn_dim=384, vocab_size=2048,
        norm_eps=1e-6, rope_theta=10000.0, max_seq_len=1024, tie_embeddings=False, init_std=0.02,
        kv_lora_rank=32, q_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_experts=8, n_experts_per_token=2, expert_ffn_dim=128, n_shared_experts=1, router_score="sigmoid",
        router_norm_topk=True, router_bias=True, router_groups=4, router_topk_groups=2, router_scale=2.5,
        dense_layers=(0,),
    ),
}
# fmt: on


def names() -> list[str]:
    """The registry's names, in table order."""
    return list(REGISTRY)


def source(name: str) -> str:
    """Where an entry's numbers come from (a URL or a note)."""
    return REGISTRY[_known(name)]["source"]


def resolve(cfg: ModelConfig) -> ModelConfig:
    """Every field filled: the registry entry `cfg.name`, overridden by cfg's non-None fields,
    the options neither sets taken from the family (`model/families.py`).

    Idempotent (resolving a resolved config returns an equal one). Raises TrainbookError naming
    the offending key when the name is unknown or the shapes do not fit together.
    """
    given = {k: v for k, v in cfg.model_dump(include=set(ARCH_FIELDS)).items() if v is not None}
    if cfg.name == FROM_HF:
        if any(given.get(k) is None for k in ARCH_FIELDS if k not in OPTIONS + MOE_FIELDS + MLA_FIELDS):
            raise TrainbookError("the architecture comes from model.init_from's config.json; set init_from = "
                                 "\"hf:PATH\"", where="model.name")
        entry, overrides = {}, {}
    else:
        entry, overrides = REGISTRY[_known(cfg.name)], given
    values = {k: entry[k] for k in ARCH_FIELDS if k in entry} | given
    fam = family(values.get("family"))
    mla = values.get("kv_lora_rank") is not None
    if mla and values.get("qk_rope_head_dim") is not None:
        values.setdefault("head_dim", values["qk_rope_head_dim"])  # the RoPE table's width
    values |= {k: v for k, v in fam.defaults(values["dim"], values["n_heads"]).items() if k not in values}
    values["family"] = fam.name
    if values.get("n_experts") is not None:
        values |= {k: v for k, v in MOE_DEFAULTS.items() if k not in values}
    resolved = ModelConfig(name=cfg.name, init_from=cfg.init_from, resize_init=cfg.resize_init, **values)
    _check_mla(resolved, overridden=set(overrides))
    _check_shapes(resolved, overridden=set(overrides), derived_head_dim=not mla and "head_dim" not in entry | given)
    _check_experts(resolved, overridden=set(overrides))
    return resolved


def is_resolved(cfg: ModelConfig) -> bool:
    """True when every architecture field is set (the model code needs no registry look-up): the
    MoE fields all of them on a mixture of experts, none needed on a dense model; the MLA fields
    all of them under multi-head latent attention, none otherwise."""
    needed = [k for k in ARCH_FIELDS if (k not in MOE_FIELDS or cfg.n_experts is not None)
              and (k not in MLA_FIELDS or cfg.kv_lora_rank is not None)]
    return all(getattr(cfg, k) is not None for k in needed)


def _known(name: str) -> str:
    if name in REGISTRY:
        return name
    close = difflib.get_close_matches(name, REGISTRY, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise TrainbookError(
        f"unknown model {name!r}{hint} (known: {', '.join(REGISTRY)})", where="model.name"
    )


def _blame(overridden: set[str], *keys: str) -> str:
    # A shape error involves two keys; blame the one the recipe set, since the registry's own
    # values are consistent (a unit test checks that), else the last one.
    return "model." + next((k for k in keys if k in overridden), keys[-1])


def _check_shapes(cfg: ModelConfig, overridden: set[str], derived_head_dim: bool) -> None:
    def blame(*keys: str) -> str:
        return _blame(overridden, *keys)

    if derived_head_dim and cfg.dim % cfg.n_heads:
        raise TrainbookError(
            f"dim={cfg.dim} is not divisible by n_heads={cfg.n_heads}",
            where=blame("dim", "n_heads"),
        )
    if cfg.n_heads % cfg.n_kv_heads:
        raise TrainbookError(
            f"n_heads={cfg.n_heads} is not a multiple of n_kv_heads={cfg.n_kv_heads} "
            "(each key/value head serves a whole group of query heads)",
            where=blame("n_heads", "n_kv_heads"),
        )
    if cfg.head_dim % 2:
        # RoPE rotates channel pairs, so each head needs an even number of channels.
        how = f"dim / n_heads = {cfg.dim} / {cfg.n_heads} = " if derived_head_dim else ""
        raise TrainbookError(
            f"head_dim = {how}{cfg.head_dim} is odd; RoPE needs an even head_dim",
            where=blame("dim", "n_heads") if derived_head_dim else "model.head_dim",
        )


def _all_or_none(cfg: ModelConfig, switch: str, fields: tuple[str, ...], required: tuple[str, ...], off: str,
                 kind: str) -> bool:
    """Whether `switch` turns the `fields` on: when it is unset none may be set (`off` says why),
    when set every `required` one must be (`kind` names what the switch makes)."""
    if getattr(cfg, switch) is None:
        stray = next((k for k in fields if getattr(cfg, k) is not None), None)
        if stray is not None:
            raise TrainbookError(f"{stray} is set but {switch} is not: {off} (set {switch} to make it {kind})",
                                 where=f"model.{stray}")
        return False
    for key in required:
        if getattr(cfg, key) is None:
            raise TrainbookError(f"{kind} ({switch}={getattr(cfg, switch)}) needs {key}", where=f"model.{key}")
    return True


def _check_mla(cfg: ModelConfig, overridden: set[str]) -> None:
    """The MLA fields fit together (`model/mla.py` can build the attention), or none is set."""
    if not _all_or_none(cfg, "kv_lora_rank", MLA_FIELDS, MLA_FIELDS, "grouped-query attention has no latents",
                        "multi-head latent attention"):
        return
    if cfg.qk_rope_head_dim % 2:
        raise TrainbookError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} is odd; RoPE needs an even width",
                             where="model.qk_rope_head_dim")
    width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.v_head_dim > width:
        raise TrainbookError(f"v_head_dim={cfg.v_head_dim} is wider than a query head (qk_nope_head_dim + "
                             f"qk_rope_head_dim = {width}); trainbook's latent attention pads values to the query "
                             "width for the fused attention kernels, not the other way", where="model.v_head_dim")
    if cfg.head_dim != cfg.qk_rope_head_dim:
        raise TrainbookError(f"head_dim={cfg.head_dim} differs from qk_rope_head_dim={cfg.qk_rope_head_dim}: under "
                             "multi-head latent attention head_dim is RoPE's width, qk_rope_head_dim",
                             where=_blame(overridden, "head_dim", "qk_rope_head_dim"))
    if cfg.n_kv_heads != cfg.n_heads:
        raise TrainbookError(f"n_kv_heads={cfg.n_kv_heads} differs from n_heads={cfg.n_heads}: multi-head latent "
                             "attention expands a key and a value for every query head",
                             where=_blame(overridden, "n_kv_heads", "n_heads"))
    for option in ("qkv_bias", "qk_norm"):
        if getattr(cfg, option):
            raise TrainbookError(f"{option} is an option of grouped-query attention; multi-head latent attention "
                                 f"(kv_lora_rank={cfg.kv_lora_rank}) has none", where=f"model.{option}")


def _check_experts(cfg: ModelConfig, overridden: set[str]) -> None:
    """The MoE fields fit together (`model/moe.py`'s router can route with them), or none is set."""
    if not _all_or_none(cfg, "n_experts", MOE_FIELDS, _MOE_REQUIRED, "a dense model has no experts",
                        "a mixture of experts"):
        return
    experts, k, groups, topk_groups = cfg.n_experts, cfg.n_experts_per_token, cfg.router_groups, cfg.router_topk_groups
    if k > experts:
        raise TrainbookError(f"n_experts_per_token={k} is more than n_experts={experts}",
                             where=_blame(overridden, "n_experts_per_token", "n_experts"))
    if experts % groups:
        raise TrainbookError(f"router_groups={groups} does not divide n_experts={experts}",
                             where=_blame(overridden, "router_groups", "n_experts"))
    if topk_groups > groups:
        raise TrainbookError(f"router_topk_groups={topk_groups} is more than router_groups={groups}",
                             where=_blame(overridden, "router_topk_groups", "router_groups"))
    per_group = experts // groups
    if groups > 1 and per_group < 2:
        raise TrainbookError(f"router_groups={groups} leaves {per_group} expert per group; group-limited routing "
                             "ranks a group by its two best experts",
                             where=_blame(overridden, "router_groups", "n_experts"))
    if k > topk_groups * per_group:
        raise TrainbookError(f"n_experts_per_token={k} is more than the {topk_groups * per_group} experts of the "
                             f"router_topk_groups={topk_groups} groups a token may choose from",
                             where=_blame(overridden, "n_experts_per_token", "router_topk_groups"))
    layers = cfg.dense_layers
    if any(i >= cfg.n_layers for i in layers):
        raise TrainbookError(f"dense_layers={list(layers)} names a layer beyond n_layers={cfg.n_layers}",
                             where=_blame(overridden, "n_layers", "dense_layers"))
    if list(layers) != sorted(set(layers)):
        raise TrainbookError(f"dense_layers={list(layers)} is not in increasing order without repeats",
                             where="model.dense_layers")
