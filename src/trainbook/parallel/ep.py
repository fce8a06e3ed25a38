"""Expert parallelism: each rank of an `ep` group holds n_experts / ep of a mixture of experts'
routed experts, and tokens travel to the rank of their expert and back by all-to-all.

`apply_ep` swaps every `GroupedExperts`' stacked weights for DTensors sharded by expert (Shard(0))
over the ep dimension of `ParallelDims.expert_mesh`, and hands its `MoE` an `ExpertExchange`.
FSDP then shards the experts over the ranks holding the same ones (parallel/apply.py) and
averages their gradients over those ranks, dp / ep of them.

The gradient's scale, the known pitfall: a rank's expert gradient already sums the tokens of
every rank of its ep group (the all-to-all's backward brought them), so that average alone
leaves the experts' gradients ep times too large. `GroupedExperts.grad_scale = 1 / ep` multiplies
them as backward produces them, before FSDP's reduction: exact for a power-of-two ep, and the
same on every backend and dtype. (FSDP2's `set_gradient_divide_factor(dp)` would be the other
way; in torch 2.13 it needs PREMUL_SUM, which gloo lacks, and with one rank per expert shard in a
dtype it pre-divides (fp64, fp16 reductions) it divides twice.)

The exchange, for one MoE layer on one rank (rows = its (token, expert) pairs sorted by expert):

    counts (E,)           --all-to-all, E / ep each-->   received (ep, E / ep): rows each source
                                                          rank sends for each of my experts
    rows, split by the    --all-to-all, uneven-->        rows from rank 0 (by expert), rank 1, ...
    owner of their expert                                 reordered by expert, sources in rank order
    my experts' outputs   <--all-to-all, reversed--      back in the sender's order

Both all-to-alls of rows carry autograd (their backward is the reverse exchange), and every
reordering is a gather by a permutation, so the backward is deterministic. One host sync per
layer: the split sizes. An expert no token reached on any rank still gets a zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from trainbook.model.moe import MoE, inverse_permutation


class ExpertExchange:
    """Sends each row to the ep rank holding its expert, runs this rank's experts, sends the
    outputs back (the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, ep: int):
        self.group, self.ep = group, ep

    def __call__(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (M, dim) sorted by expert, counts (E,) -> the experts' outputs (M, dim), same order."""
        ep, local = self.ep, counts.numel() // self.ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(ep, local)  # [source rank, my expert]
        send = counts.view(ep, local).sum(dim=1)
        splits = torch.cat([send, received.sum(dim=1)]).tolist()  # the one host sync
        send_splits, recv_splits = splits[:ep], splits[ep:]
        arrived = funcol.all_to_all_single_autograd(rows, recv_splits, send_splits, self.group)
        by_expert = by_expert_order(received)
        out = experts(arrived[by_expert], received.sum(dim=0))
        back = out[inverse_permutation(by_expert)]  # source by source again
        return funcol.all_to_all_single_autograd(back, send_splits, recv_splits, self.group)


def by_expert_order(received: torch.Tensor) -> torch.Tensor:
    """received (sources, experts) row counts, rows laid out source by source (each source's by
    expert) -> the permutation that lays them out expert by expert (each expert's by source)."""
    sizes = received.flatten()
    starts = (torch.cumsum(sizes, 0) - sizes).view_as(received).t().flatten()  # source-major start of each block
    blocks = received.t().flatten()  # the blocks in expert-major order
    block_of_row = torch.repeat_interleave(torch.arange(blocks.numel(), device=sizes.device), blocks)
    first_row = torch.cumsum(blocks, 0) - blocks
    rows = torch.arange(block_of_row.numel(), device=sizes.device)
    return starts[block_of_row] + rows - first_row[block_of_row]


def apply_ep(model: nn.Module, ep_mesh) -> None:
    """Shard every MoE layer's routed experts over `ep_mesh` (Shard(0): by expert) and route its
    tokens through an `ExpertExchange`."""
    group = ep_mesh.get_group()
    for module in model.modules():
        if isinstance(module, MoE):
            experts = module.experts
            for name, param in list(experts.named_parameters(recurse=False)):
                # every rank built the same full experts: each keeps its slice, nothing is sent
                sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
                experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            experts.grad_scale = 1.0 / ep_mesh.size()
            module.exchange = ExpertExchange(group, ep_mesh.size())


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The routed experts of every MoE layer of `model` (each FSDP-sharded on its own mesh)."""
    return [m.experts for m in model.modules() if isinstance(m, MoE)]
