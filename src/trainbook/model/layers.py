"""The decoder's small shared layers: RMSNorm and rotary position embedding (RoPE), used by both
attentions (`model/llama.py`'s grouped-query one, `model/mla.py`'s latent one)."""

from __future__ import annotations

import torch
from torch import nn

from trainbook.config.model import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * gain, with the statistics in fp32 so bf16 activations normalise accurately."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None):
    """cos, sin of position * frequency, each (max_seq_len, head_dim / 2), fp32.

    Channel pair i rotates at theta^(-2i / head_dim) radians per position: fast pairs resolve
    nearby tokens, slow ones distant tokens.
    """
    head_dim = cfg.head_dim
    inv_freq = cfg.rope_theta ** -(
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )  # (head_dim / 2,)
    positions = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (max_seq_len, head_dim / 2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x (B, T, heads, head_dim) by position angles.

    cos/sin are (T, head_dim / 2), or (B, T, head_dim / 2) when each sequence has its own
    positions. Rotation keeps q.k a function of the position *difference* only. Computed in fp32.
    """
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, T, heads, head_dim / 2) each
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]  # (1, T, head_dim / 2)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B or 1, T, 1, head_dim / 2)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.type_as(x)
