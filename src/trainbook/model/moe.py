"""The mixture-of-experts feed-forward: a router picks each token's top-k experts, the experts
(SwiGLUs with their weights stacked) run on the tokens sent to them, and their outputs are summed
with the router's weights; optional shared experts see every token.

Routing (`Router`), in fp32 whatever the compute dtype, two ways:
- `softmax` (Qwen3-MoE): scores = softmax(logits) over the experts, the top-k by score, weights
  the chosen scores, renormalised to sum to 1 with `router_norm_topk`;
- `sigmoid` (DeepSeek-V3): scores = sigmoid(logits); the experts are chosen by scores + a
  per-expert bias (`expert_bias`, a buffer: aux-loss-free balancing moves it, the optimizer never
  does) but weighted by the unbiased scores; with groups, a token chooses only among the experts
  of its `router_topk_groups` best groups (a group ranked by the sum of its two best biased
  scores); renormalised, then times `router_scale`.
Either kind may use the bias, the groups and the scale: they are options of one router.

Dispatch is dropless: every (token, expert) pair is computed, none is dropped for capacity. The
pairs are sorted by expert (tokens in order within each), so each expert's tokens are one slice
and `GroupedExperts` runs them all in three `torch._grouped_mm` calls, or, where that kernel does
not run (`grouped_mm_runs`), one matmul per expert; the two give the same result, bit for bit
(the activation runs once over all rows either way: CPU elementwise kernels round a tensor's
vectorised body and its tail differently, so silu per expert would not). The weights are one
tensor per projection, so an expert no token chose still gets a gradient: zeros.

The combine is fp32 and in a fixed order: each token adds its experts' weighted outputs one by one
in the router's top-k order, as transformers 5's grouped_mm experts sum them (its default
`experts_implementation`); nothing is accumulated by atomics, and every gather's backward
scatters into distinct rows, so the backward is deterministic too.

Module paths (`model/llama.py` documents them with the rest): `feed_forward.router.gate`
(nn.Linear(dim, n_experts)), `feed_forward.router.expert_bias` (with `router_bias`),
`feed_forward.experts.{w1,w3}` (n_experts, expert_ffn_dim, dim) and `feed_forward.experts.w2`
(n_experts, dim, expert_ffn_dim), each expert's slice an nn.Linear weight (out, in) as Hugging
Face stores it, and `feed_forward.shared.{w1,w2,w3}` (a SwiGLU of n_shared_experts x
expert_ffn_dim).

What training reads from a router (train/experts.py balances and reports with it), kept by
training forwards only (gradients on: not an evaluation, not a rollout's sampling) and once per
micro-batch: `tally`, the tokens each expert got since `Router.reset`; `entropy_sum` and `tokens`,
the summed entropy of the tokens' score distributions; with `aux_loss` on, `aux` (the last
forward's balancing loss, with its graph) and `aux_sum` / `aux_count`.

Under activation checkpointing a block's forward runs again in backward. That recompute takes
the choice the forward made (`keep_choice`: a queue, since a pipeline runs several micro-batches'
forwards before their backwards) instead of routing again, so a near tie decided one way in
forward cannot be decided the other way in the recompute (the gradients would then belong to
experts the output never used); and it adds nothing to the tallies.

Expert parallelism (parallel/ep.py) leaves this module's code as it is: it shards the stacked
weights by expert (DTensors; `GroupedExperts` computes with this rank's slice) and sets
`MoE.exchange`, which takes the rows sorted by expert and their counts where `GroupedExperts`
would, sends them to their experts' ranks by all-to-all, and brings the outputs back.

Sources, transformers 5.x: `models/qwen3_moe/modeling_qwen3_moe.py` (`Qwen3MoeTopKRouter`,
`Qwen3MoeExperts`, `Qwen3MoeSparseMoeBlock`), `models/deepseek_v3/modeling_deepseek_v3.py`
(`DeepseekV3TopkRouter`, `DeepseekV3MoE`: routed + shared experts).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from trainbook.config.model import ModelConfig

# What torch._grouped_mm computes in (torch 2.13: fp32/bf16/fp16 on CPU; CUDA: its bf16 kernel on
# sm90+, a loop of matmuls elsewhere), and the alignment it checks: every stride but the unit one,
# and each operand's start, a multiple of 16 bytes.
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GROUPED_MM_DEVICES = ("cpu", "cuda")
_ALIGN = 16


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether block `layer` of model `cfg` has an MoE feed-forward (else the dense SwiGLU)."""
    return cfg.n_experts is not None and layer not in cfg.dense_layers


class Routing(NamedTuple):
    weights: torch.Tensor
    """(N, k) fp32: each token's weight on each chosen expert."""
    experts: torch.Tensor
    """(N, k) int64: the chosen experts, in top-k order (by score for `softmax`; for `sigmoid` in
    topk's unsorted order, as DeepSeek-V3 leaves them): the renormalising sum and the combine run
    in that order."""
    scores: torch.Tensor
    """(N, n_experts) fp32: every expert's score (softmax or sigmoid, no bias), with its graph:
    the ingredient of an auxiliary balancing loss."""
    counts: torch.Tensor
    """(n_experts,) int64: tokens routed to each expert."""


class Router(nn.Module):
    """Top-k routing over `n_experts` (the module docstring says how), in fp32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.n_experts_per_token
        self.score, self.norm_topk, self.scale = cfg.router_score, cfg.router_norm_topk, cfg.router_scale
        self.groups, self.topk_groups = cfg.router_groups, cfg.router_topk_groups
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.expert_bias: torch.Tensor | None
        if cfg.router_bias:
            # Persistent: checkpoints carry it, since balancing, not the optimizer, sets it.
            self.register_buffer("expert_bias", torch.empty(cfg.n_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.counts: torch.Tensor | None = None
        """(n_experts,) int64: tokens each expert received in the last forward (None before any)."""
        self.keep_choice = False
        """The block is activation-checkpointed: keep each training forward's choice for its recompute."""
        self.aux_loss = False
        """Compute the balancing loss in training forwards (`aux`; config/moe.py says which)."""
        self._kept: deque[torch.Tensor] = deque()
        self.reset()

    def reset(self) -> None:
        """Zero what training forwards add up (`tally`, `entropy_sum`, `tokens`, the aux sums)."""
        self.tally: torch.Tensor | int = 0
        """(n_experts,) int64: tokens routed to each expert by training forwards since the reset."""
        self.entropy_sum: torch.Tensor | float = 0.0
        """Summed entropy (nats) of those tokens' normalised scores, fp64."""
        self.tokens = 0
        self.aux: torch.Tensor | None = None
        """The last training forward's balancing loss (fp32 scalar with its graph), with `aux_loss`."""
        self.aux_sum: torch.Tensor | float = 0.0
        self.aux_count = 0

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.gate.weight, mean=0.0, std=std)
        if self.expert_bias is not None:
            nn.init.zeros_(self.expert_bias)

    def forward(self, x: torch.Tensor) -> Routing:
        """x (N, dim) -> the routing of its N tokens."""
        # fp32 logits even under autocast (which would run this matmul in bf16): near-ties between
        # experts are decided by the last bits.
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())  # (N, E)
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()  # (N, E)
        # Inside backward (the autograd engine runs a graph task) this is a checkpointed block's
        # recompute: the forward's choice, not a new one, and nothing counted twice.
        recompute = self.keep_choice and torch._C._current_graph_task_id() != -1
        if recompute:
            experts = self._kept.popleft()
        else:
            experts = self._choose(scores)
        weights = scores.gather(-1, experts)  # (N, k)
        if self.norm_topk:
            # + 1e-20 (DeepSeek-V3's guard against an all-zero sigmoid row) leaves any sum above
            # ~1e-12 unchanged in fp32, so Qwen3-MoE's plain division is matched too.
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scale != 1.0:
            weights = weights * self.scale
        counts = torch.bincount(experts.flatten(), minlength=self.n_experts)  # (E,)
        self.counts = counts
        if torch.is_grad_enabled() and not recompute:
            self._record(scores, experts, counts)
        return Routing(weights, experts, scores, counts)

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """(N, E) scores -> the (N, k) experts each token goes to."""
        with torch.no_grad():  # the choice only picks indices; the weights come from `scores`
            choice = scores if self.expert_bias is None else scores + self.expert_bias
            if self.groups > 1:
                choice = self._within_best_groups(choice)
            # sorted as each reference sorts (Qwen3-MoE: by score; DeepSeek-V3: unsorted), so the
            # renormalising sum below adds in its order and the weights match it bit for bit.
            return torch.topk(choice, self.top_k, dim=-1, sorted=self.score == "softmax").indices  # (N, k)

    def _record(self, scores: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor) -> None:
        """A training forward: keep the choice for the recompute, add to the tallies, and the
        balancing loss E x sum_e f_e P_e (config/moe.py; Megatron's, and 1 / k of transformers'
        Qwen3-MoE `load_balancing_loss_func` over one layer, which counts f per choice slot)."""
        if self.keep_choice:
            self._kept.append(experts)
        n = scores.shape[0]
        self.tally = self.tally + counts
        with torch.no_grad():
            p = scores / scores.sum(dim=-1, keepdim=True)  # sigmoid scores do not sum to 1
            entropy = -(p * p.clamp_min(1e-30).log()).sum(dim=-1)  # (N,)
            self.entropy_sum = self.entropy_sum + entropy.double().sum()
        self.tokens += n
        if self.aux_loss and n > 0:
            share = counts.float() / (n * self.top_k)  # f_e: each expert's share of the choices
            self.aux = self.n_experts * (share * scores.mean(dim=0)).sum()
            self.aux_sum = self.aux_sum + self.aux.detach()
            self.aux_count += 1

    def _within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` (N, E) with -inf outside each token's `topk_groups` best groups of experts."""
        n = choice.shape[0]
        grouped = choice.view(n, self.groups, -1)  # (N, G, E / G)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (N, G): each group's best two
        best = group_scores.topk(self.topk_groups, dim=-1, sorted=False).indices  # (N, topk_groups)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (N, G)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(n, -1)


class GroupedExperts(nn.Module):
    """`n_experts` SwiGLUs, w2(silu(w1 x) * w3 x) each, their weights stacked: w1, w3 (E, hidden,
    dim), w2 (E, dim, hidden); expert e's slice is an nn.Linear weight (out, in)."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))  # gate
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))  # back into the residual stream
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))  # value
        self.use_grouped_mm = True
        """Run the experts with torch._grouped_mm where it runs (`grouped_mm_runs`); False: always
        one matmul per expert."""
        self.grad_scale = 1.0
        """What the weights' gradients are multiplied by as backward produces them (expert
        parallelism's 1 / ep: parallel/ep.py says why)."""

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1, mean=0.0, std=std)
        nn.init.normal_(self.w3, mean=0.0, std=std)
        nn.init.normal_(self.w2, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, dim), rows sorted by expert: counts[e] (counts (E,) int64) rows for expert e in
        turn -> (M, dim), in the compute dtype (autocast's, else the weights')."""
        dtype = _compute_dtype(self.w1, x.device.type)
        x = x.to(dtype)
        # Under expert parallelism the weights are DTensors sharded by expert: this rank's experts.
        w1, w2, w3 = (_scale_grad(_local(w), self.grad_scale).to(dtype) for w in (self.w1, self.w2, self.w3))
        if self.use_grouped_mm and x.shape[0] > 0 and grouped_mm_runs(x, w1, w2, w3):
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # (E,): where each expert's rows end

            def matmul(a, w):
                # w.mT: the (E, in, out) view grouped_mm multiplies by, with no copy (column-major).
                return torch._grouped_mm(a, w.mT, offs=offsets)
        else:
            sizes = counts.tolist()  # one host sync: the loop needs its slices' lengths

            def matmul(a, w):
                return torch.cat([F.linear(rows, w[e]) for e, rows in enumerate(a.split(sizes))])
        h = F.silu(matmul(x, w1)) * matmul(x, w3)  # (M, hidden)
        return matmul(h, w2)  # (M, dim)


def grouped_mm_runs(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes x (M, dim) against expert weights (E, out, in) seen through
    `.mT`: a dtype and device it computes in, and 16-byte aligned starts and strides (on this
    machine's torch 2.13 CPU build: fp32, bf16 and fp16 when dim and the hidden size are multiples
    of 4 fp32 or 8 bf16 elements; fp64 or a hidden size of 6 fp32 elements fall back)."""
    if not hasattr(torch, "_grouped_mm") or x.device.type not in _GROUPED_MM_DEVICES:
        return False
    if x.dtype not in _GROUPED_MM_DTYPES or any(w.dtype != x.dtype for w in weights):
        return False
    size = x.element_size()
    return all(t.data_ptr() % _ALIGN == 0 and all(s * size % _ALIGN == 0 for s in t.stride() if s != 1)
               for t in (x, *weights))  # fmt: skip


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `order` (x[order][inverse] == x): gathers by it backward into
    distinct rows, so their backward is deterministic."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _scale_grad(w: torch.Tensor, scale: float) -> torch.Tensor:
    return w if scale == 1.0 else _ScaleGrad.apply(w, scale)


def _compute_dtype(weight: torch.Tensor, device_type: str) -> torch.dtype:
    # torch._grouped_mm is not on autocast's list: cast as autocast would cast a matmul.
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


class MoE(nn.Module):
    """The MoE feed-forward of one block: router, routed experts, and `shared` (a SwiGLU every
    token passes through, DeepSeek-V3's shared experts; None: none), summed."""

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None = None):
        super().__init__()
        self.top_k = cfg.n_experts_per_token
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.expert_ffn_dim)
        self.shared = shared
        self.exchange = None
        """Expert parallelism's all-to-all around the experts (parallel/ep.py); None: all here."""

    def init_weights(self, std: float, out_std: float) -> None:
        """Router gate and expert w1/w3 normal(0, std), expert w2 normal(0, out_std), as the dense
        SwiGLU; the selection bias 0. The draw order is fixed: router, experts, shared."""
        self.router.init_weights(std)
        self.experts.init_weights(std, out_std)
        if self.shared is not None:
            self.shared.init_weights(std, out_std)

    def active_numel(self) -> int:
        """Parameters one token passes through (model/count.py): the router's gate, k experts'
        three matrices, the shared experts."""
        routed = sum(w.shape[1] * w.shape[2] for w in (self.experts.w1, self.experts.w2, self.experts.w3))
        shared = sum(p.numel() for p in self.shared.parameters()) if self.shared is not None else 0
        return self.router.gate.weight.numel() + self.top_k * routed + shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., dim) -> (..., dim) in x's dtype."""
        shape, k = x.shape, self.top_k
        x = x.reshape(-1, shape[-1])  # (N, dim)
        n = x.shape[0]
        routing = self.router(x)
        # Dispatch: the N k (token, expert) pairs sorted by expert, tokens in order within each.
        order = torch.argsort(routing.experts.flatten(), stable=True)  # (N k,)
        # expand + reshape, not x[order // k]: its backward sums each token's k copies in a fixed
        # order rather than by index_add.
        pairs = x[:, None, :].expand(n, k, shape[-1]).reshape(n * k, shape[-1])  # (N k, dim)
        rows = pairs[order]  # (N k, dim), sorted by expert
        if self.exchange is None:
            out = self.experts(rows, routing.counts)
        else:
            out = self.exchange(self.experts, rows, routing.counts)
        # Back to (token, expert) order through the inverse permutation: a gather, not a scatter.
        out = out[inverse_permutation(order)].view(n, k, -1)  # (N, k, dim)
        weights = routing.weights  # (N, k) fp32
        y = out[:, 0].float() * weights[:, :1]  # (N, dim) fp32
        for j in range(1, k):  # one by one: the sum's order is fixed
            y = y + out[:, j].float() * weights[:, j : j + 1]
        if self.shared is not None:
            y = y + self.shared(x).float()
        return y.to(x.dtype).view(shape)
