"""Multi-head latent attention (MLA), DeepSeek-V2's and DeepSeek-V3's: keys and values expanded per
head from one small latent per token, queries from another (or projected directly), and RoPE on a
few channels only, through one rotated key shared by every head.

Per token x (dim), with H heads, n = qk_nope_head_dim, r = qk_rope_head_dim, v = v_head_dim:
  q      = wq_b(q_a_norm(wq_a(x)))  (H, n + r)     or wq(x) when q_lora_rank = 0
  c, k_r = wkv_a(x)                 (kv_lora_rank), (r): the latent and the shared rotated key
  k_n, v = wkv_b(kv_a_norm(c))      (H, n), (H, v)
  q = [q_n, rope(q_r)], k = [k_n, rope(k_r) for every head]; softmax(q k / sqrt(n + r)) v -> wo
Only c and k_r need caching at inference (DeepSeek's point); training keeps the expanded keys and
values, as the reference implementations do outside their decode kernels.

RoPE rotates interleaved channel pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints lay them
out (transformers' `rope_interleave = true`): the rotated channels come out evens first, then odds,
for queries and keys alike, so their dot products are those of the interleaved rotation.

Module paths (`model/hf.py` maps them): `attention.{wq | wq_a, q_a_norm, wq_b}`, `attention.wkv_a`,
`attention.kv_a_norm`, `attention.wkv_b`, `attention.wo`. The latents' RMSNorms use eps 1e-6
whatever `norm_eps` is, as transformers' `DeepseekV3Attention` builds them.

Source: transformers 5.x `models/deepseek_v3/modeling_deepseek_v3.py` (`DeepseekV3Attention`,
`apply_rotary_pos_emb_interleave`); DeepSeek-V2 (arXiv:2405.04434), section 2.1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainbook.config.model import ModelConfig
from trainbook.model.kv_cache import LayerCache
from trainbook.model.layers import RMSNorm, apply_rope

LATENT_EPS = 1e-6
"""The epsilon of the latents' norms (`q_a_norm`, `kv_a_norm`)."""


class LatentAttention(nn.Module):
    """Causal multi-head latent attention: `Attention`'s interface (`model/llama.py`), MLA's math."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        heads = cfg.n_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        if cfg.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, heads * qk, bias=False)
            self.wq_a = self.q_a_norm = self.wq_b = None
        self.wkv_a = nn.Linear(cfg.dim, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_rank, LATENT_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, cfg.dim, bias=False)
        self.attention_width = heads * (qk + self.v_dim) // 2
        """Attention's FLOPs per position, as a query width (`model/count.py`): the scores take
        n + r channels a head, the weighted sum v."""

    def init_weights(self, std: float, out_std: float) -> None:
        for lin in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if lin is not None:
                nn.init.normal_(lin.weight, mean=0.0, std=std)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)
        for norm in (self.q_a_norm, self.kv_a_norm):
            if norm is not None:
                norm.reset_parameters()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None,
        kv: LayerCache | None = None,
    ) -> torch.Tensor:
        """As `Attention.forward`: x (B, T, dim); cos/sin (T, r / 2) or (B, T, r / 2); mask None
        (causal) or boolean (B, 1, T, T) ((B, 1, T, cached + T) with `kv`)."""
        bsz, seq_len, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q_nope, q_rot = q.view(bsz, seq_len, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)  # (B, T, kv_rank), (B, T, r)
        expanded = self.wkv_b(self.kv_a_norm(latent)).view(bsz, seq_len, -1, self.nope + self.v_dim)
        k_nope, v = expanded.split([self.nope, self.v_dim], dim=-1)  # (B, T, H, n), (B, T, H, v)
        if cos.dim() == 2:  # one table for every sequence: positions 0..T-1
            cos, sin = cos[:seq_len], sin[:seq_len]
        q_rot = apply_rope(_evens_then_odds(q_rot), cos, sin)  # (B, T, H, r)
        k_rot = apply_rope(_evens_then_odds(k_rot[:, :, None]), cos, sin)  # (B, T, 1, r): one for every head
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, n + r) and (B, H, T, v)
        if kv is not None:
            k, v = kv.extend(k, v)
        # Values padded with zeros to the queries' width: the fused (flash) kernels take one head
        # width, and with two torch falls back to the math path, which keeps every head's T x T
        # scores for backward (torch 2.13 CPU). The padded channels come out zero and are dropped.
        width = self.nope + self.rope
        padded = F.pad(v, (0, width - self.v_dim)) if self.v_dim < width else v
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, padded, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, padded, attn_mask=mask)
        out = out[..., : self.v_dim]  # (B, H, T, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))  # (B, T, H * v) -> (B, T, dim)


def _evens_then_odds(x: torch.Tensor) -> torch.Tensor:
    """Channels (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): the interleaved pairs in
    `apply_rope`'s half-split layout, pair i becoming channels (i, i + r / 2)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
