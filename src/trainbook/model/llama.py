"""The decoder of every family trainbook trains: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Llama 3 is the plain form (no biases, head_dim = dim / n_heads). The other families are
options of the same class, set by `ModelConfig` (defaults from `model/families.py`): Qwen2.5 adds
biases to the q/k/v projections (`qkv_bias`), Qwen3 an RMSNorm over each query and key head
before RoPE (`qk_norm`) and a head_dim of its own (`head_dim`, 128 where dim / n_heads is 64 or 80),
Qwen3-MoE a mixture of experts as the feed-forward (`n_experts`, ...: `model/moe.py`) in every
layer but `dense_layers`, DeepSeek-V3 that and multi-head latent attention (`kv_lora_rank`, ...:
`model/mla.py`). RMSNorm and RoPE live in `model/layers.py`.

Conventions that `parallel/`, checkpoints and HF import rely on (keep them stable):
- module paths: `tok_embeddings`, `layers.<i>.attention.{wq,wk,wv,wo}` (and, with the options,
  `wq/wk/wv.bias`, `layers.<i>.attention.{q_norm,k_norm}`; with latent attention, `kv_lora_rank`,
  `layers.<i>.attention.{wq | wq_a, q_a_norm, wq_b}, {wkv_a, kv_a_norm, wkv_b}, wo`: model/mla.py),
  `layers.<i>.feed_forward.{w1,w2,w3}`,
  `layers.<i>.{attention_norm,ffn_norm}`, `norm`, `output`; an MoE layer's feed-forward instead
  `layers.<i>.feed_forward.router.gate` (nn.Linear dim -> n_experts; with `router_bias`, the
  buffer `router.expert_bias`), `layers.<i>.feed_forward.experts.{w1,w2,w3}` (parameters,
  experts stacked on dim 0: w1/w3 (n_experts, expert_ffn_dim, dim), w2 (n_experts, dim,
  expert_ffn_dim)) and, with shared experts, `layers.<i>.feed_forward.shared.{w1,w2,w3}`;
- blocks live in an `nn.ModuleDict` keyed "0".."N-1", so a pipeline stage can delete some and
  `forward` runs whichever remain (a stage may also set `tok_embeddings`/`norm`/`output` to None);
- head counts are never read from the config in `forward` (reshapes use -1), so tensor parallel
  can shard heads across ranks;
- RoPE uses the half-split ("rotate_half") channel layout of Hugging Face `LlamaForCausalLM`, so HF
  weights load without permuting wq/wk; Meta's original checkpoints need the usual permutation;
- construction allocates but does not initialise: `init_weights()` fills parameters and the RoPE
  tables, so a model built on the meta device can be materialised (`to_empty`) and then initialised.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from trainbook.config.model import ModelConfig
from trainbook.errors import TrainbookError
from trainbook.model.kv_cache import KVCache, LayerCache
from trainbook.model.layers import RMSNorm, apply_rope, rope_tables
from trainbook.model.loss import ChunkedLoss, full_cross_entropy, linear_cross_entropy
from trainbook.model.mla import LatentAttention
from trainbook.model.moe import MoE, is_moe_layer
from trainbook.model.registry import is_resolved, resolve


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert is_resolved(cfg), "Llama needs a resolved ModelConfig (model.registry.resolve)"
        self.cfg = cfg
        # Given its (uninitialised) weight, nn.Embedding skips its own normal_ init: on the meta
        # device that op runs a Python decomposition whose first call imports torch._dynamo (1.3 s
        # of CPU in every process that only counts a model: the launcher, `plan`). init_weights fills it.
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.chunked_loss: ChunkedLoss | None = None
        """Set by parallel/apply.py when the run's loss is chunked (`train.loss`); None: full logits."""
        self.context_parallel = None
        """Set by parallel/apply.py under context parallelism (parallel/cp.py's ContextParallel):
        each sequence arrives as this rank's share, with its positions, and every attention
        gathers the other ranks' keys and values."""
        self.hidden_out = False
        """A pipeline's last stage under a chunked loss returns normed hidden states: its loss
        function applies the head (`loss`)."""
        # (max_seq_len, head_dim / 2) each. Non-persistent: derived from the config, so they stay
        # out of checkpoints; fp32 because bf16 angles lose whole rotations at long positions.
        half = cfg.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, half), persistent=False)
        if self.rope_cos.device.type != "meta":
            # Built directly on a real device: make it usable at once, like any nn.Module.
            self.init_weights()

    def tie_weights(self) -> None:
        """Make `output.weight` the same tensor as `tok_embeddings.weight` if the config ties them.

        Idempotent. Anything that swaps parameters out (`to_empty` from meta, some parallel
        wrappers) unties them; `init_weights` re-ties, and parallel code calls this afterwards.
        """
        if self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill every parameter and the RoPE tables; deterministic given torch's RNG state.

        normal(0, init_std) for embeddings and input projections (routers and experts' w1/w3
        included); the projections that write into the residual stream (wo, w2, experts' w2) are
        scaled down by 1/sqrt(2 * n_layers) so its variance does not grow with depth (GPT-2); norm
        gains 1; a router's selection bias 0.
        """
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        self.tie_weights()
        # The draw order is fixed (embedding, blocks in order, head) so a seed gives one model.
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for block in self.layers.values():
            block.init_weights(std, out_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, mean=0.0, std=std)
        cos, sin = rope_tables(self.cfg, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, masked: bool = False,
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab_size), in the compute dtype; with `targets`
        (B, T) int64, the mean next-token loss instead (fp32 scalar, `loss`); with `masked` too,
        the sum over the targets that are not `model.loss.IGNORE` (fine-tuning's loss masks).

        `positions` (B, T) int64, for windows packed with several documents: each token's position
        in its document, 0 where a document (or the window) starts. RoPE then uses these positions
        and attention stays within each document; without them, positions are 0..T-1 and attention
        is plainly causal (no mask is built).

        A pipeline stage without `tok_embeddings` takes hidden states (B, T, dim) instead, and one
        without `output` returns them.

        With `cache` (generation, model/sampler.py): `tokens` are the next T slots of the cached
        sequences and `positions` (B, T) their positions; each attention writes its keys and values
        into the cache and attends over every slot so far (`KVCache.mask`), and only the last
        slot's logits are returned (B, 1, vocab_size).
        """
        seq_len = tokens.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise TrainbookError(
                f"a sequence of {seq_len} tokens is longer than max_seq_len={self.cfg.max_seq_len}",
                where="model.max_seq_len",
            )
        # (B, T, dim); a later pipeline stage receives hidden states already.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if cache is not None:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (B, T, head_dim / 2)
            mask = cache.mask(seq_len)  # (B, 1, T, length + T)
            for name, block in self.layers.items():
                h = block(h, cos, sin, mask, kv=cache.layer(name))
            cache.advance(seq_len)
            return self.output(self.norm(h[:, -1:]))  # (B, 1, vocab_size)
        cp, kv = self.context_parallel, None
        if positions is None and cp is not None:
            # A pipeline stage under context parallelism (its schedule hands over tokens or hidden
            # states only): this rank's share of an unpacked sequence, at its global positions.
            positions = cp.index(seq_len * cp.cp, h.device).expand(h.shape[0], -1)  # (B, T / cp)
        if positions is None:
            # The whole table: each attention cuts it to its own (gathered) sequence length, since
            # a later pipeline stage under sequence parallel receives a shard of the sequence here.
            cos, sin = self.rope_cos, self.rope_sin  # (max_seq_len, head_dim / 2)
            mask = None
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (B, T, head_dim / 2)
            if cp is None:
                mask = document_mask(positions)  # (B, 1, T, T)
            else:  # this rank's share of each sequence: its queries over every rank's keys
                mask, kv = cp.mask(positions), cp.kv  # (B, 1, T, T x cp)
        for block in self.layers.values():
            h = block(h, cos, sin, mask, kv)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None or self.hidden_out:
            return h  # (B, T, dim)
        return self.output(h) if targets is None else self.loss(h, targets, masked)  # (B, T, vocab_size) or ()

    def loss(self, h: torch.Tensor, targets: torch.Tensor, masked: bool = False) -> torch.Tensor:
        """Mean cross entropy of the head's logits for normed hidden states h (B, T, dim) against
        targets (B, T) (`masked`: the sum over trained targets): chunked when `chunked_loss` is
        set (model/loss.py), else from full logits."""
        c = self.chunked_loss
        if c is not None:
            return linear_cross_entropy(h, self.output.weight, targets, c.chunk_tokens, c.compiled, masked)
        return full_cross_entropy(self.output(h), targets, masked)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask (B, 1, T, T), True where query t may attend to key u: u <= t and
    both in the same document (documents numbered by the running count of position-0 tokens)."""
    seq_len = positions.shape[1]
    doc = torch.cumsum(positions == 0, dim=1)  # (B, T)
    same_doc = doc[:, :, None] == doc[:, None, :]  # (B, T, T)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=positions.device).tril()
    return (same_doc & causal)[:, None]


class Block(nn.Module):
    """Pre-norm residual block: h + attention(norm(h)), then h + feed_forward(norm(h)).

    The feed-forward of block `layer` is a SwiGLU of ffn_dim, or in an MoE model (`n_experts`) a
    mixture of experts (`model/moe.py`) unless the layer is one of `dense_layers`. The attention is
    grouped-query, or multi-head latent attention (`model/mla.py`) when `kv_lora_rank` is set.
    """

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = LatentAttention(cfg) if cfg.kv_lora_rank is not None else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: FeedForward | MoE
        if is_moe_layer(cfg, layer):
            shared = FeedForward(cfg.dim, cfg.n_shared_experts * cfg.expert_ffn_dim) if cfg.n_shared_experts else None
            self.feed_forward = MoE(cfg, shared)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(std, out_std)
        self.ffn_norm.reset_parameters()
        self.feed_forward.init_weights(std, out_std)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None,
        kv: LayerCache | None = None,
    ) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h), cos, sin, mask, kv)
        return h + self.feed_forward(self.ffn_norm(h))


class Attention(nn.Module):
    """Causal grouped-query attention: n_kv_heads key/value heads, each shared by a group of
    n_heads / n_kv_heads consecutive query heads (query head j reads kv head j // group)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.attention_width = cfg.n_heads * self.head_dim
        """Attention's FLOPs per position, as a query width (`model/count.py`)."""
        # One gain of head_dim shared by every head (and, under tensor parallel, by every rank).
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def init_weights(self, std: float, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.normal_(lin.weight, mean=0.0, std=std)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)
        # After the draws above, so a model without the options draws exactly what it always did.
        for lin in (self.wq, self.wk, self.wv):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None,
        kv: LayerCache | None = None,
    ) -> torch.Tensor:
        """x (B, T, dim); cos/sin (T, head_dim / 2) or per token (B, T, head_dim / 2); mask None
        (causal) or boolean (B, 1, T, T), True where attention is allowed (causality included).
        With `kv` (generation), the keys and values join the cached ones and `mask` is
        (B, 1, T, cached + T)."""
        bsz, seq_len, _ = x.shape
        # -1, not n_heads: under tensor parallel each rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim)  # (B, T, n_heads, head_dim)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        if self.q_norm is not None:  # per head, over its head_dim channels
            q, k = self.q_norm(q), self.k_norm(k)
        if cos.dim() == 2:  # one table for every sequence: positions 0..T-1
            cos, sin = cos[:seq_len], sin[:seq_len]  # (T, head_dim / 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        if kv is not None:
            k, v = kv.extend(k, v)  # (B, kv_heads, cached + T, head_dim)
        # enable_gqa shares each kv head with its query group inside the kernel instead of
        # materialising repeated k/v: less memory, and on torch 2.13 CPU no slower (tiny model,
        # 16 x 256 tokens forward+backward: 0.46-0.62 s per step vs 0.54-0.62 s with repeats).
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(bsz, seq_len, -1)  # (B, T, n_heads * head_dim)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # back into the residual stream
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # value

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1.weight, mean=0.0, std=std)
        nn.init.normal_(self.w3.weight, mean=0.0, std=std)
        nn.init.normal_(self.w2.weight, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def build_model(cfg: ModelConfig, device: torch.device | str, seed: int) -> Llama:
    """A Llama whose weights depend only on `seed` (and the device type), initialised on `device`.

    Built on the meta device first, so no memory is spent on a throw-away CPU init, then
    materialised on `device` and initialised under a forked RNG: the caller's RNG state is left
    exactly as it was. `device="meta"` returns an unmaterialised model (shapes, param counts).
    """
    cfg = cfg if is_resolved(cfg) else resolve(cfg)
    device = torch.device(device)
    with torch.device("meta"):
        model = Llama(cfg)
    if device.type == "meta":
        return model
    model.to_empty(device=device)
    with _seeded_rng(device, seed):
        model.init_weights()
    return model


@contextlib.contextmanager
def _seeded_rng(device: torch.device, seed: int):
    """Seed the RNG that init on `device` draws from, and restore every forked state afterwards.

    Only the generators of `device`'s type are seeded: `torch.manual_seed` would also (lazily)
    seed accelerators we did not fork, leaking into the caller's state.
    """
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            yield
        return
    accel = torch.get_device_module(device.type)  # torch.cuda, torch.npu (torch_npu), ...
    devices = list(range(accel.device_count()))
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.random.default_generator.manual_seed(seed)
        accel.manual_seed_all(seed)
        yield
