"""The mixture-of-experts feed-forward (model/moe.py): routing and blocks against transformers'
Qwen3-MoE and DeepSeek-V3 modules, the grouped_mm and per-expert paths against each other and a
per-token reference, gradients of idle experts, the seams left for balancing, init, counts and
the config's checks.

The transformers modules are built offline from tiny random configs and every weight is random
(transformers starts routers at zero), with shapes nobody defaults to: 8 or 16 experts of 24
hidden units, a 64-wide residual, top-3 or top-4 (a renormalising sum of more than two terms,
whose order shows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

from trainbook.config.model import ModelConfig
from trainbook.errors import TrainbookError
from trainbook.model import build_model, count, resolve
from trainbook.model.llama import FeedForward
from trainbook.model.moe import MoE, Router, grouped_mm_runs
from trainbook.model.registry import MOE_FIELDS

DIM, HIDDEN = 64, 24


def moe_config(**fields) -> ModelConfig:
    """tiny-moe at the width of the transformers modules below, with `fields` set."""
    return resolve(ModelConfig(name="tiny-moe", dim=DIM, expert_ffn_dim=HIDDEN, **fields))


def qwen3_moe_config(k: int, norm: bool) -> transformers.Qwen3MoeConfig:
    config = transformers.Qwen3MoeConfig(hidden_size=DIM, num_experts=8, num_experts_per_tok=k,
                                         moe_intermediate_size=HIDDEN, norm_topk_prob=norm)  # fmt: skip
    config._experts_implementation = "grouped_mm"  # transformers 5's default in a PreTrainedModel
    return config


def deepseek_v3_config(norm: bool) -> transformers.DeepseekV3Config:
    config = transformers.DeepseekV3Config(hidden_size=DIM, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=norm,
                                           moe_intermediate_size=HIDDEN, n_shared_experts=2)  # fmt: skip
    config._experts_implementation = "grouped_mm"
    return config


# The same routing in trainbook's words.
DEEPSEEK = dict(n_experts=16, n_experts_per_token=4, router_score="sigmoid", router_bias=True, router_groups=4,
                router_topk_groups=2, router_scale=2.5, n_shared_experts=2)  # fmt: skip


def randomise(module: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter (and DeepSeek's selection bias) normal(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.copy_(0.1 * torch.randn(t.shape, generator=g))


def copy_from_transformers(ours: MoE, theirs: torch.nn.Module) -> None:
    """Their weights into ours: the fused gate_up_proj (E, 2 hidden, dim) is [w1; w3]."""
    with torch.no_grad():
        ours.router.gate.weight.copy_(theirs.gate.weight)
        if ours.router.expert_bias is not None:
            ours.router.expert_bias.copy_(theirs.gate.e_score_correction_bias)
        ours.experts.w1.copy_(theirs.experts.gate_up_proj[:, :HIDDEN])
        ours.experts.w3.copy_(theirs.experts.gate_up_proj[:, HIDDEN:])
        ours.experts.w2.copy_(theirs.experts.down_proj)
        if ours.shared is not None:
            for w, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                getattr(ours.shared, w).weight.copy_(getattr(theirs.shared_experts, name).weight)


def hidden(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))


class ContiguousSilu(torch.nn.Module):
    """silu of a contiguous copy: see test_blocks_match_transformers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x.contiguous())


# ---- routing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [False, True], ids=["raw", "renormalised"])
def test_softmax_router_matches_qwen3_moe_bit_for_bit(norm):
    theirs = qwen3_moe.Qwen3MoeTopKRouter(qwen3_moe_config(k=3, norm=norm))
    randomise(theirs)
    ours = Router(moe_config(n_experts_per_token=3, router_norm_topk=norm))
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.weight)
    x = hidden(200)
    logits, weights, experts = theirs(x)
    routing = ours(x)
    assert torch.equal(routing.experts, experts)  # the same experts, in the same (descending) order
    assert torch.equal(routing.weights, weights)
    assert torch.equal(routing.scores, logits.softmax(dim=-1))
    assert torch.allclose(routing.weights.sum(-1), torch.ones(200)) is norm


@pytest.mark.parametrize("norm", [False, True], ids=["raw", "renormalised"])
def test_sigmoid_group_limited_router_matches_deepseek_v3_bit_for_bit(norm):
    theirs = deepseek.DeepseekV3TopkRouter(deepseek_v3_config(norm))
    randomise(theirs)
    ours = Router(moe_config(**DEEPSEEK, router_norm_topk=norm))
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.weight)
        ours.expert_bias.copy_(theirs.e_score_correction_bias)
    x = hidden(200)
    _, weights, experts = theirs(x)
    routing = ours(x)
    assert torch.equal(routing.experts, experts) and torch.equal(routing.weights, weights)
    # The bias and the groups both decided something: without them the top 4 differ for most tokens.
    plain = routing.scores.topk(4, dim=-1).indices.sort(-1).values
    assert (plain != experts.sort(-1).values).any(-1).float().mean() > 0.5
    # Weights are the unbiased sigmoid scores (times 2.5, renormalised or not).
    raw = routing.scores.gather(-1, experts)
    expected = raw / (raw.sum(-1, keepdim=True) + 1e-20) * 2.5 if norm else raw * 2.5
    assert torch.equal(routing.weights, expected)


def test_the_router_keeps_what_balancing_needs():
    """Per-expert token counts of the last forward, and the fp32 scores with their graph (an
    auxiliary loss's ingredients); the selection bias a buffer that checkpoints carry and the
    optimizer never sees, changing which experts are chosen but not their weights."""
    router = Router(moe_config(n_experts_per_token=2, router_bias=True, router_norm_topk=False))
    router.init_weights(0.02)
    assert router.counts is None
    routing = router(hidden(50))
    assert torch.equal(router.counts, torch.bincount(routing.experts.flatten(), minlength=8))
    assert router.counts.sum() == 100 and routing.counts is router.counts
    assert routing.scores.dtype == torch.float32 and routing.scores.requires_grad
    assert torch.allclose(routing.scores.sum(-1), torch.ones(50))
    assert "expert_bias" in router.state_dict() and "expert_bias" not in dict(router.named_parameters())
    assert torch.equal(router.expert_bias, torch.zeros(8))
    with torch.no_grad():
        router.expert_bias[5] = 10.0  # expert 5 wins every token's selection
    biased = router(hidden(50))
    assert (biased.experts == 5).any(-1).all()
    assert torch.equal(biased.weights, biased.scores.gather(-1, biased.experts))  # unbiased scores


def test_the_router_runs_in_fp32_under_autocast():
    router = Router(moe_config())
    router.init_weights(0.02)
    x = hidden(20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = router(x.bfloat16())
    assert routing.scores.dtype == routing.weights.dtype == torch.float32
    assert torch.equal(routing.scores, router(x.bfloat16().float()).scores)


# ---- blocks against transformers -----------------------------------------------------------------


def qwen3_block(k: int):
    theirs = qwen3_moe.Qwen3MoeSparseMoeBlock(qwen3_moe_config(k, norm=True))
    return theirs, MoE(moe_config(n_experts_per_token=k))


def deepseek_block(k: int):
    theirs = deepseek.DeepseekV3MoE(deepseek_v3_config(norm=True))
    return theirs, MoE(moe_config(**DEEPSEEK), FeedForward(DIM, 2 * HIDDEN))


@pytest.mark.parametrize("build, k", [(qwen3_block, 2), (qwen3_block, 4), (deepseek_block, 4)],
                         ids=["qwen3-top2", "qwen3-top4", "deepseek-v3-shared-groups"])  # fmt: skip
def test_blocks_match_transformers(build, k, one_thread):
    """Against Qwen3MoeSparseMoeBlock and DeepseekV3MoE (routed + 2 shared experts, sigmoid,
    groups, bias, scale) with transformers 5's default grouped_mm experts: within 1e-6 of the
    output's scale (measured here: 7.9e-8 top-2, 4.7e-8 top-4, 3.1e-8 DeepSeek), and bit for bit once
    their silu runs on a contiguous tensor. The whole difference is that one op: transformers
    applies silu to `gate_up.chunk(2)[0]`, a strided view, and the CPU kernel rounds a strided
    input (scalar path) differently from a contiguous one (vectorised); trainbook's w1 output is
    contiguous. Everything else (routing, dispatch, the grouped matmuls, the weighting, the fp32
    combine in top-k order, the shared experts) is equal."""
    torch.manual_seed(0)
    theirs, ours = build(k)
    randomise(theirs)
    copy_from_transformers(ours, theirs)
    x = torch.randn(2, 50, DIM, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, out = theirs(x), ours(x)
        assert (out - expected).abs().max() <= 1e-6 * expected.abs().max()
        theirs.experts.act_fn = ContiguousSilu()
        assert torch.equal(ours(x), theirs(x))


# ---- dispatch: grouped_mm and the per-expert loop -------------------------------------------------


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE written the slow, obvious way: each token through each of its experts in turn."""
    routing = moe.router(x)
    e = moe.experts
    out = []
    for token, experts, weights in zip(x, routing.experts, routing.weights):
        y = sum(w * F.linear(F.silu(F.linear(token, e.w1[i])) * F.linear(token, e.w3[i]), e.w2[i])
                for i, w in zip(experts.tolist(), weights))  # fmt: skip
        out.append(y + (moe.shared(token) if moe.shared is not None else 0))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_mm_and_the_per_expert_loop_agree_bit_for_bit(dtype, monkeypatch):
    """Forward and every gradient; grouped_mm runs here (this CPU's torch 2.13: fp32, bf16, fp16)."""
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or grouped_mm(*a, **kw))
    torch.manual_seed(0)
    moe = MoE(moe_config(**DEEPSEEK), FeedForward(DIM, 2 * HIDDEN)).to(dtype)
    moe.init_weights(0.1, 0.05)
    x = torch.randn(3, 40, DIM, dtype=dtype)
    results = []
    for use_grouped_mm in (True, False):
        moe.experts.use_grouped_mm = use_grouped_mm
        xi = x.clone().requires_grad_()
        out = moe(xi)
        out.square().sum().backward()
        results.append([out, xi.grad, *(p.grad for p in moe.parameters())])
        moe.zero_grad(set_to_none=True)
    assert len(calls) == 3  # w1, w3, w2 on the first pass (backward calls the kernel inside autograd)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert results[0][0].dtype == dtype
    torch.testing.assert_close(results[0][0].float(), reference(moe, x.reshape(-1, DIM)).float().view(3, 40, DIM),
                               **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))  # fmt: skip


def test_grouped_mm_runs_where_its_kernel_takes_the_operands():
    """Expert weights as stored, (E, out, in): w1 (E, hidden, dim), w2 (E, dim, hidden)."""
    x, w1, w2 = torch.zeros(10, DIM), torch.zeros(4, 8, DIM), torch.zeros(4, DIM, 8)  # fp32: 256- and 32-byte rows
    assert grouped_mm_runs(x, w1, w2)
    assert grouped_mm_runs(x.bfloat16(), w1.bfloat16(), w2.bfloat16()) and grouped_mm_runs(x.half(), w1.half())
    assert not grouped_mm_runs(x.double(), w1.double(), w2.double())  # no fp64 kernel
    assert not grouped_mm_runs(x, w1.bfloat16())  # mixed dtypes
    assert not grouped_mm_runs(x, torch.zeros(4, 6, DIM), torch.zeros(4, DIM, 6))  # hidden 6 fp32: 24-byte rows
    assert not grouped_mm_runs(x.bfloat16(), torch.zeros(4, DIM, 4, dtype=torch.bfloat16))  # 8-byte rows
    assert not grouped_mm_runs(torch.zeros(10, DIM + 1)[:, 1:], w1)  # starts 4 bytes in


def test_a_hidden_size_grouped_mm_cannot_take_falls_back_to_the_loop(monkeypatch):
    monkeypatch.setattr(torch, "_grouped_mm", None)  # would fail if called
    torch.manual_seed(0)
    moe = MoE(resolve(ModelConfig(name="tiny-moe", dim=DIM, expert_ffn_dim=6)))
    moe.init_weights(0.1, 0.05)
    x = hidden(30)
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("use_grouped_mm", [True, False], ids=["grouped_mm", "loop"])
def test_experts_no_token_chose_get_zero_gradients(use_grouped_mm):
    torch.manual_seed(0)
    moe = MoE(moe_config())
    moe.init_weights(0.1, 0.05)
    moe.experts.use_grouped_mm = use_grouped_mm
    moe(hidden(2)).sum().backward()  # 2 tokens x top-2: at most 4 of the 8 experts
    used = moe.router.counts > 0
    assert 0 < used.sum() <= 4
    for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        assert w.grad is not None and w.grad.shape == w.shape
        assert torch.equal(w.grad[~used], torch.zeros_like(w.grad[~used]))
        assert all(g.abs().sum() > 0 for g in w.grad[used])


# ---- in the model ----------------------------------------------------------------------------------


def test_moe_layers_paths_and_init():
    cfg = resolve(ModelConfig(name="tiny-moe", router_bias=True, n_shared_experts=1))
    model = build_model(cfg, "cpu", seed=0)
    assert cfg.dense_layers == (0,)
    assert isinstance(model.layers["0"].feed_forward, FeedForward)
    assert all(isinstance(model.layers[str(i)].feed_forward, MoE) for i in (1, 2, 3))
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items() if n.startswith("layers.1.feed_forward.")}
    assert shapes == {
        "layers.1.feed_forward.router.gate.weight": (8, 128),
        "layers.1.feed_forward.router.expert_bias": (8,),
        "layers.1.feed_forward.experts.w1": (8, 128, 128),
        "layers.1.feed_forward.experts.w3": (8, 128, 128),
        "layers.1.feed_forward.experts.w2": (8, 128, 128),
        "layers.1.feed_forward.shared.w1.weight": (128, 128),
        "layers.1.feed_forward.shared.w3.weight": (128, 128),
        "layers.1.feed_forward.shared.w2.weight": (128, 128),
    }
    moe, out_std = model.layers["1"].feed_forward, cfg.init_std / (2 * cfg.n_layers) ** 0.5
    assert torch.equal(moe.router.expert_bias, torch.zeros(8))
    for w, std in ((moe.router.gate.weight, cfg.init_std), (moe.experts.w1, cfg.init_std), (moe.experts.w2, out_std)):
        assert abs(w.std().item() - std) < 0.1 * std
    again = build_model(cfg, "cpu", seed=0).state_dict()
    assert all(torch.equal(t, again[n]) for n, t in model.state_dict().items())
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, targets=tokens)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_count_of_an_moe_model():
    cfg = resolve(ModelConfig(name="tiny-moe"))
    c, model = count(cfg), build_model(cfg, "meta", seed=0)
    assert c.total == sum(p.numel() for p in model.parameters()) == 1_921_408
    per_expert = 3 * cfg.dim * cfg.expert_ffn_dim
    moe_layers = cfg.n_layers - len(cfg.dense_layers)
    assert c.total - c.active == moe_layers * (cfg.n_experts - cfg.n_experts_per_token) * per_expert
    # Matmul weights: what a token passes through but the norm gains (the tied head counts, once).
    assert c.matmul == c.active - (2 * cfg.n_layers + 1) * cfg.dim - 2 * cfg.n_layers * cfg.head_dim


# ---- config ----------------------------------------------------------------------------------------


def test_a_dense_model_sets_no_moe_field():
    cfg = resolve(ModelConfig(name="tiny"))
    assert all(getattr(cfg, k) is None for k in MOE_FIELDS)
    assert not set(MOE_FIELDS) & set(cfg.model_dump(exclude_none=True))  # saved configs read as before
    moe = resolve(ModelConfig(name="tiny", n_experts=4, n_experts_per_token=1, expert_ffn_dim=64))
    assert (moe.router_score, moe.router_norm_topk, moe.n_shared_experts, moe.dense_layers) == ("softmax", True, 0, ())
    assert resolve(moe) == moe


@pytest.mark.parametrize("name, overrides, where, message", [
    ("tiny-moe", dict(n_experts_per_token=9), "n_experts_per_token", "n_experts_per_token=9 is more than n_experts=8"),
    ("tiny-moe", dict(router_groups=3), "router_groups", "router_groups=3 does not divide n_experts=8"),
    ("tiny-moe", dict(router_groups=2, router_topk_groups=3), "router_topk_groups", "router_topk_groups=3 is more"),
    ("tiny-moe", dict(router_groups=8), "router_groups", "leaves 1 expert per group"),
    ("tiny-moe", dict(router_groups=4, n_experts_per_token=3), "n_experts_per_token",
     "n_experts_per_token=3 is more than the 2 experts of the router_topk_groups=1 groups"),
    ("tiny-moe", dict(dense_layers=(1, 4)), "dense_layers", "names a layer beyond n_layers=4"),
    ("tiny-moe", dict(n_layers=2, dense_layers=(0, 3)), "n_layers", "names a layer beyond n_layers=2"),
    ("tiny-moe", dict(dense_layers=(2, 1)), "dense_layers", "not in increasing order"),
    ("tiny", dict(router_score="sigmoid"), "router_score", "router_score is set but n_experts is not"),
    ("tiny", dict(n_experts=8, expert_ffn_dim=64), "n_experts_per_token", "needs n_experts_per_token"),
])  # fmt: skip
def test_moe_fields_that_do_not_fit_name_the_key(name, overrides, where, message):
    with pytest.raises(TrainbookError, match=message) as err:
        resolve(ModelConfig(name=name, **overrides))
    assert err.value.where == f"model.{where}" and "\n" not in str(err.value)
