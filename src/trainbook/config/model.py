"""`[model]`: the architecture, a registry entry, a Hugging Face config.json or a trainbook run's
model with overrides, and the weights it starts from."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from trainbook.config.section import Section

INIT_FROM_KINDS = ("hf:", "run:")


class ModelConfig(Section):
    name: str = "tiny"
    """A registry name (`trainbook.model.registry`), or `from_hf`: the architecture of `init_from`'s
    config.json; the fields below override its values."""
    init_from: str | None = None
    """Where the weights start: `hf:PATH`, a Hugging Face directory (Llama, Qwen2/Qwen2.5, Qwen3,
    Qwen3-MoE or DeepSeek-V3), its config.json the architecture and its tokenizer the run's; or
    `run:PATH`, a trainbook run
    directory (its newest valid checkpoint) or one of its checkpoints, its config.resolved.toml's
    [model] the architecture, its tokenizer the run's (a trained one read from the run's
    tokenizer/ folder) and a LoRA run's adapters merged into the base weights. Either way the
    fields below may only repeat the source's, except a larger `vocab_size`, `max_seq_len` and
    `init_std`; a recipe's `tokenizer.chat_template` still applies."""
    resize_init: Literal["mean", "normal"] = "mean"
    """Rows added when `vocab_size` exceeds the imported vocabulary: the mean of the existing
    embeddings, or normal(0, init_std)."""
    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"] | None = None
    """The decoder's family (`trainbook.model.families`): the Hugging Face architecture its
    config.json and weights are read and written as, and the defaults of the options below."""
    dim: int | None = Field(default=None, ge=1)
    """Hidden size."""
    n_layers: int | None = Field(default=None, ge=1)
    """Number of transformer blocks."""
    n_heads: int | None = Field(default=None, ge=1)
    """Attention heads."""
    n_kv_heads: int | None = Field(default=None, ge=1)
    """Key/value heads (grouped-query attention); must divide `n_heads`."""
    vocab_size: int | None = Field(default=None, ge=1)
    """Embedding rows; must be at least the tokenizer's vocabulary."""
    head_dim: int | None = Field(default=None, ge=2)
    """Channels per attention head; unset: dim / n_heads (Qwen3 sets it: 128 at every size)."""
    qkv_bias: bool | None = None
    """Biases on the query, key and value projections, none on the output one (Qwen2)."""
    qk_norm: bool | None = None
    """RMSNorm over each query and key head, after the head split and before RoPE (Qwen3)."""
    # Multi-head latent attention (`model/mla.py`, DeepSeek-V2/V3). Unset on grouped-query
    # attention, every one of them; `kv_lora_rank` makes the attention MLA, which then needs all.
    kv_lora_rank: int | None = Field(default=None, ge=1)
    """MLA: the width of the latent every key and value is expanded from (DeepSeek-V3: 512);
    unset: grouped-query attention."""
    q_lora_rank: int | None = Field(default=None, ge=0)
    """MLA: the width of the latent the queries are expanded from (DeepSeek-V3: 1536); 0: queries
    projected directly from the residual stream (HF `q_lora_rank: null`, DeepSeek-V2-Lite)."""
    qk_nope_head_dim: int | None = Field(default=None, ge=1)
    """MLA: the channels of each query and key head that RoPE leaves alone (DeepSeek-V3: 128)."""
    qk_rope_head_dim: int | None = Field(default=None, ge=2)
    """MLA: the channels of each query head that RoPE rotates, and of the one rotated key shared by
    every head (DeepSeek-V3: 64); `head_dim` (the RoPE table's width) equals it."""
    v_head_dim: int | None = Field(default=None, ge=1)
    """MLA: the channels of each value head (DeepSeek-V3: 128)."""
    ffn_dim: int | None = Field(default=None, ge=1)
    """SwiGLU hidden size."""
    norm_eps: float | None = Field(default=None, gt=0)
    """RMSNorm epsilon."""
    rope_theta: float | None = Field(default=None, gt=0)
    """RoPE base frequency."""
    max_seq_len: int | None = Field(default=None, ge=1)
    """Longest sequence the RoPE table covers."""
    tie_embeddings: bool | None = None
    """Share the token embedding with the output head."""
    init_std: float | None = Field(default=None, gt=0)
    """Standard deviation of the normal weight init (output projections scaled by depth)."""
    # A mixture of experts (`model/moe.py`). Unset on a dense model, every one of them; an MoE
    # model sets the first three and `model.registry.MOE_DEFAULTS` fills the others.
    n_experts: int | None = Field(default=None, ge=1)
    """Routed experts in each MoE layer (HF `num_experts`, DeepSeek-V3 `n_routed_experts`); unset:
    a dense model, every layer a SwiGLU of `ffn_dim`."""
    n_experts_per_token: int | None = Field(default=None, ge=1)
    """Experts each token is routed to (top-k; HF `num_experts_per_tok`); at most `n_experts`."""
    expert_ffn_dim: int | None = Field(default=None, ge=1)
    """SwiGLU hidden size of each routed expert (HF `moe_intermediate_size`)."""
    n_shared_experts: int | None = Field(default=None, ge=0)
    """Experts every token passes through besides its routed ones, as one SwiGLU of
    n_shared_experts x expert_ffn_dim (DeepSeek-V3's `n_shared_experts`); 0: none (Qwen3-MoE)."""
    router_score: Literal["softmax", "sigmoid"] | None = None
    """How the router turns its logits into scores: a softmax over the experts (Qwen3-MoE) or a
    sigmoid per expert (DeepSeek-V3)."""
    router_norm_topk: bool | None = None
    """Renormalise each token's top-k scores to sum to 1 (HF `norm_topk_prob`)."""
    router_bias: bool | None = None
    """A per-expert bias added to the scores to choose experts, not to weight them (DeepSeek-V3's
    `e_score_correction_bias`, aux-loss-free balancing): a buffer, moved by balancing, not by the
    optimizer."""
    router_groups: int | None = Field(default=None, ge=1)
    """Groups the experts are split into for group-limited routing (DeepSeek-V3 `n_group`); must
    divide `n_experts`; 1: no groups."""
    router_topk_groups: int | None = Field(default=None, ge=1)
    """Groups a token may choose its experts from, the groups whose two best scores sum highest
    (DeepSeek-V3 `topk_group`); at most `router_groups`."""
    router_scale: float | None = Field(default=None, gt=0)
    """Factor on the routed experts' weights (DeepSeek-V3 `routed_scaling_factor`); 1: none."""
    dense_layers: tuple[Annotated[int, Field(ge=0)], ...] | None = None
    """The layers of an MoE model that keep a dense SwiGLU of `ffn_dim`, in increasing order
    (Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`, DeepSeek-V3's
    `first_k_dense_replace` = k: the first k layers); empty: every layer routes."""

    @field_validator("init_from")
    @classmethod
    def _known_source(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(INIT_FROM_KINDS):
            raise ValueError(f"{value!r} is neither hf:PATH (a Hugging Face model directory) nor run:PATH "
                             "(a trainbook run or checkpoint)")
        return value
