"""The key/value cache of batched generation (model/sampler.py), as `Llama.forward` reads it.

A batch of B sequences shares one slot axis of `capacity` slots. Prompts of uneven length are
left-padded, so every row's next token goes to the same slot and one forward serves the batch;
`valid` (B, capacity) says which slots hold a row's real tokens. Each attention layer keeps its
keys and values (B, kv_heads, capacity, head_dim), allocated on first write from the shapes it
sees, so a tensor-parallel rank caches only its own heads.

A query at slot q attends to the valid slots up to q, and always to itself: a padding slot then
attends to itself alone instead of to nothing. Attention kernels differ on a query that may attend
to nothing (torch 2.13's CPU kernel returns zeros; others return NaN), and a NaN value at a padding
slot, even weighted 0, reaches every real token after it through the matmul.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One attention layer's keys and values."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, kv_heads, T, head_dim) of the forward's T new slots -> the keys and values of
        every slot so far (B, kv_heads, length + T, head_dim)."""
        start, end = self.owner.length, self.owner.length + k.shape[2]
        if self.k is None:
            # A value's head_dim may differ from a key's (multi-head latent attention).
            self.k = k.new_zeros(k.shape[0], k.shape[1], self.owner.capacity, k.shape[3])
            self.v = v.new_zeros(v.shape[0], v.shape[1], self.owner.capacity, v.shape[3])
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every layer for a batch of sequences, `length` slots filled so far."""

    def __init__(self, valid: torch.Tensor):
        self.valid = valid  # (B, capacity) bool
        self.capacity = valid.shape[1]
        self.length = 0
        self.layers: dict[str, LayerCache] = {}

    def layer(self, name: str) -> LayerCache:
        if name not in self.layers:
            self.layers[name] = LayerCache(self)
        return self.layers[name]

    def mask(self, new: int) -> torch.Tensor:
        """Boolean (B, 1, new, length + new): query slot q (of the `new` about to be written) may
        attend to key slot u if u is valid and u <= q, or u == q."""
        end = self.length + new
        if end > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} slots; {end} were asked for")
        device = self.valid.device
        query = torch.arange(self.length, end, device=device)[:, None]  # (new, 1)
        key = torch.arange(end, device=device)[None, :]  # (1, length + new)
        causal = key <= query
        own = key == query
        return ((self.valid[:, None, :end] & causal) | own)[:, None]  # (B, 1, new, length + new)

    def advance(self, new: int) -> None:
        self.length += new
