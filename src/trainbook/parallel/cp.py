"""Context parallelism: each sequence split over the `cp` ranks of a context-parallel group.

Every rank of a cp group reads the same samples (one data-parallel rank) and keeps 1 / cp of each
sequence's positions: its tokens, targets, loss mask and positions (`shard`). Everything but
attention is per position and runs on the rank's share as it would on the whole. Attention keeps
the rank's queries and gathers every rank's keys and values (an all-gather over cp whose backward
reduce-scatters their gradients back); the mask comes from the global index of each query and key
(and the document each belongs to under packing), never from `is_causal`, whose diagonal is wrong
when queries and keys differ in number. RoPE takes each query's and key's own position, computed
before the gather. The loss is each rank's mean over its share (the shares are equal), which the
gradient's average over dp_shard x cp and the reported loss's over dp x cp make the sequence's.

How positions are dealt (`cp_load_balance`):
- `head_tail`: the sequence cut into 2 x cp chunks, rank r holding chunks r and 2 cp - 1 - r. Under a
  causal mask a chunk late in the sequence attends to many keys, an early one to few: each rank
  gets one of each, so each computes about as much (the Megatron / torchtitan layout).
- `none`: rank r holds the r-th contiguous 1 / cp (for checking; the last rank does the most work).

A rank's gathered keys and values are in rank order (rank 0's share, then rank 1's, ...):
`key_index` is the global position of each, so no reordering is needed, only a mask built from it.

Memory: a rank's activations are those of T / cp positions, except the gathered keys and values
of the whole sequence each attention keeps for backward (parallel/plan_memory.py counts both).
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import all_gather_single, all_gather_single_autograd


def local_index(seq_len: int, cp: int, rank: int, balance: str, device=None) -> torch.Tensor:
    """The global positions (T / cp,) that cp rank `rank` holds of a sequence of `seq_len`."""
    if balance == "none":
        size = seq_len // cp
        return torch.arange(rank * size, (rank + 1) * size, device=device)
    size = seq_len // (2 * cp)
    head = torch.arange(rank * size, (rank + 1) * size, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * size, (2 * cp - rank) * size, device=device)
    return torch.cat((head, tail))


class ContextParallel:
    """This rank's place in its cp group, and what the model needs to run a sequence split so."""

    def __init__(self, mesh, balance: str):
        """`mesh`: the 1-D cp mesh of this rank's group."""
        self.cp = mesh.size()
        self.rank = mesh.get_local_rank()
        self.balance = balance
        self.group = mesh.get_group()
        self.kv = GatheredKV(self)
        """The attentions' `kv` (model/llama.py): every rank's keys and values."""

    def index(self, seq_len: int, device=None) -> torch.Tensor:
        """This rank's global positions of a sequence of `seq_len` (the whole, not the share)."""
        return local_index(seq_len, self.cp, self.rank, self.balance, device)

    def key_index(self, seq_len: int, device=None) -> torch.Tensor:
        """The global position of each gathered key (T,): every rank's share, in rank order."""
        return torch.cat([local_index(seq_len, self.cp, r, self.balance, device) for r in range(self.cp)])

    def shard(self, batch):
        """This rank's share of every sequence of `batch` (a data.samples.Batch, or a producer's
        batch type with the same fields) (B, T) -> (B, T / cp): tokens, targets,
        loss mask, and positions (a batch without them gets its global positions 0..T-1, which the
        model needs once a sequence is split)."""
        seq_len = batch.inputs.shape[1]
        index = self.index(seq_len, batch.inputs.device)
        positions = batch.positions
        if positions is None:
            positions = torch.arange(seq_len, device=batch.inputs.device).expand_as(batch.inputs)
        mask = batch.loss_mask
        return batch._replace(inputs=batch.inputs[:, index], targets=batch.targets[:, index],
                              positions=positions[:, index], loss_mask=None if mask is None else mask[:, index])

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every cp rank's `t`, concatenated along `dim` in rank order (autograd: the backward
        reduce-scatters the gradient back to each rank's share)."""
        return all_gather_single_autograd(t.contiguous(), gather_dim=dim, group=self.group)

    def mask(self, positions: torch.Tensor) -> torch.Tensor:
        """The attention mask (B, 1, T / cp, T) of this rank's queries over the gathered keys, True
        where query t may attend to key u: u at or before t in the sequence, and in the same
        document. `positions` (B, T / cp): each local token's position in its document (0 where a
        document starts; a batch without packing has its global positions, one document)."""
        seq_len = positions.shape[1] * self.cp
        query = self.index(seq_len, positions.device)  # (T / cp,)
        key = self.key_index(seq_len, positions.device)  # (T,)
        causal = key[None, :] <= query[:, None]  # (T / cp, T)
        # Document ids from the whole sequence's starts, in global order.
        starts = torch.zeros(positions.shape[0], seq_len, dtype=torch.long, device=positions.device)
        gathered = all_gather_single(positions.contiguous(), gather_dim=1, group=self.group)
        starts[:, key] = (gathered == 0).long()
        doc = torch.cumsum(starts, dim=1)  # (B, T)
        same = doc[:, query][:, :, None] == doc[:, key][:, None, :]  # (B, T / cp, T)
        return (same & causal)[:, None]


class GatheredKV:
    """The attention's `kv` under context parallelism: `extend(k, v)` returns every cp rank's keys
    and values of the sequence, as a KV cache returns every slot so far (model/llama.py)."""

    def __init__(self, cp: ContextParallel):
        self.cp = cp

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, heads, T / cp, head_dim) -> (B, heads, T, head_dim), in rank order."""
        return self.cp.gather(k, dim=2), self.cp.gather(v, dim=2)
