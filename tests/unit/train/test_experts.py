"""Balancing a mixture of experts (train/experts.py, config/moe.py) through the real step: the
auxiliary loss against transformers' and scaled like the main loss under accumulation, the
selection bias moved by every micro-batch's tokens, activation checkpointing that neither routes
again nor counts twice, and the expert load a logged step reports."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

from trainbook.config import ModelConfig, PrecisionConfig
from trainbook.config.moe import MoeConfig
from trainbook.data.samples import Batch
from trainbook.model import build_model, resolve
from trainbook.model.moe import Router
from trainbook.parallel.apply import checkpoint_block
from trainbook.phase import PhaseTracker
from trainbook.precision import Precision
from trainbook.train.engine import LocalEngine
from trainbook.train.experts import Experts
from trainbook.train.step import Step

VOCAB, SEQ = 96, 16


def tiny_moe(**fields):
    """tiny-moe cut down: 3 layers (layer 0 dense), 8 experts, top 2, dim 32."""
    cfg = resolve(ModelConfig(name="tiny-moe", n_layers=3, dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                              expert_ffn_dim=16, vocab_size=VOCAB, **fields))
    return cfg, build_model(cfg, "cpu", seed=0)


def batches(seed: int, rows: int) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return [Batch(tokens[i:i + 1, :-1], tokens[i:i + 1, 1:]) for i in range(rows)]


def joined(parts: list[Batch]) -> Batch:
    return Batch(torch.cat([b.inputs for b in parts]), torch.cat([b.targets for b in parts]))


def train_step(model, cfg, moe: MoeConfig, micro: list[Batch]) -> Experts:
    """One AdamW step of `model` over the micro-batches `micro`, through Step and LocalEngine."""
    precision = Precision(PrecisionConfig(dtype="fp32"), "cpu")
    engine = LocalEngine.one_process(model, precision)
    experts = Experts(model, cfg, moe, engine.rt, len(micro))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = Step.next_token(engine, optimizer, len(micro), 1.0, precision.loss_scaler(), PhaseTracker())
    step.experts = experts
    step(iter(micro))
    return experts


def routers(model) -> list[Router]:
    return [m for m in model.modules() if isinstance(m, Router)]


def test_the_aux_loss_is_transformers_over_one_layer_divided_by_k(one_thread):
    """transformers' `load_balancing_loss_func` counts a token once per choice slot (k x ours) and
    pools every layer before multiplying; over one layer the two agree up to that factor."""
    cfg, model = tiny_moe(n_experts_per_token=3)
    router = routers(model)[0]
    router.aux_loss = True
    x = torch.randn(40, cfg.dim, generator=torch.Generator().manual_seed(1))
    router(x)
    logits = x @ router.gate.weight.T
    theirs = qwen3_moe.load_balancing_loss_func((logits,), num_experts=cfg.n_experts, top_k=3)
    torch.testing.assert_close(router.aux * 3, theirs, rtol=1e-6, atol=0)
    assert 1.0 <= router.aux.item() < cfg.n_experts / 3  # 1 when even, E / k when collapsed


def test_the_aux_loss_weighs_on_each_micro_batch_as_the_main_loss_does(one_thread):
    """Accumulation 2 over the same batch twice is accumulation 1 over it, bit for bit, with the
    balancing loss on: each micro-batch carries half of both losses. (Not divided by the
    accumulation, the balancing loss would weigh twice as much in the first run.)"""
    moe = MoeConfig(balance="aux_loss", aux_loss_coef=0.5)  # large, so a wrong scale shows
    batch = joined(batches(0, 4))
    results = []
    for micro in ([batch], [batch, batch]):
        cfg, model = tiny_moe()
        experts = train_step(model, cfg, moe, micro)
        results.append(([p.detach().clone() for p in model.parameters()], experts.report(experts.take())))
    (once, load1), (twice, load2) = results
    assert all(torch.equal(a, b) for a, b in zip(once, twice))
    assert [v["aux_loss"] for v in load1.values()] == [v["aux_loss"] for v in load2.values()]
    assert all(v["tokens"] == [2 * t for t in load1[k]["tokens"]] for k, v in load2.items())
    cfg, unbalanced = tiny_moe()  # and the balancing loss trains something: without it the routers differ
    train_step(unbalanced, cfg, MoeConfig(), [batch])
    gates = [i for i, (n, _) in enumerate(unbalanced.named_parameters()) if n.endswith("router.gate.weight")]
    assert any(not torch.equal(once[i], list(unbalanced.parameters())[i]) for i in gates)


def test_the_bias_moves_by_the_tokens_of_every_micro_batch(one_thread):
    """After the step each selection bias moved by rate x sign(mean - load), the load counted over
    both micro-batches (each routed alone by an identical model, to know the counts)."""
    micro = batches(3, 4)
    halves = [joined(micro[:2]), joined(micro[2:])]
    cfg, reference = tiny_moe(router_bias=True)
    expected_counts = [torch.zeros(cfg.n_experts, dtype=torch.int64) for _ in routers(reference)]
    with torch.no_grad():
        for half in halves:
            reference(half.inputs)
            for total, router in zip(expected_counts, routers(reference)):
                total += router.counts
    cfg, model = tiny_moe(router_bias=True)
    train_step(model, cfg, MoeConfig(balance="bias", bias_update_rate=0.25), halves)
    for counts, router in zip(expected_counts, routers(model)):
        load = counts.double()
        assert torch.equal(router.expert_bias, 0.25 * torch.sign(load.mean() - load).float())
    assert any(router.expert_bias.abs().sum() > 0 for router in routers(model))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_reuses_the_choice_and_counts_once(mode, one_thread):
    """Activation checkpointing on vs off: the same gradients, bit for bit, and the same token
    counts. Then the choice is changed under the recompute's feet (every selection bias pushed
    towards other experts between forward and backward): the gradients stay those of the choice
    the forward made, which a recompute that routed again would not give."""
    batch = joined(batches(5, 2))
    runs = {}
    for name in ("plain", "checkpointed", "bias changed"):
        cfg, model = tiny_moe(router_bias=True)
        if name != "plain":
            for block in model.layers.values():
                checkpoint_block(block, selective=mode == "selective")
        loss = model(batch.inputs, targets=batch.targets)
        if name == "bias changed":
            for router in routers(model):
                router.expert_bias.copy_(torch.linspace(5.0, -5.0, cfg.n_experts))  # would reroute every token
        loss.backward()
        runs[name] = ([p.grad.clone() for p in model.parameters()], [r.tally.clone() for r in routers(model)])
    grads, tallies = runs["plain"]
    for name in ("checkpointed", "bias changed"):
        assert all(torch.equal(a, b) for a, b in zip(grads, runs[name][0])), name
        assert all(torch.equal(a, b) for a, b in zip(tallies, runs[name][1])), name
    assert all(int(t.sum()) == batch.inputs.numel() * 2 for t in tallies)  # k = 2 choices a token, once


def test_the_load_report_reads_what_the_routers_counted(one_thread):
    cfg, model = tiny_moe()
    experts = train_step(model, cfg, MoeConfig(), batches(7, 2))
    load = experts.report(experts.take())
    assert list(load) == ["layers.1", "layers.2"]  # layer 0 is dense
    for v in load.values():
        tokens = v["tokens"]
        assert sum(tokens) == 2 * SEQ * 2
        assert v["imbalance"] == round(max(tokens) / (sum(tokens) / cfg.n_experts), 4)
        assert v["idle_frac"] == sum(t == 0 for t in tokens) / cfg.n_experts
        assert 0 < v["entropy"] <= torch.log(torch.tensor(float(cfg.n_experts))).item() + 1e-6
        assert v["aux_loss"] is None
    assert experts.report(experts.take())["layers.1"]["tokens"] == [0] * cfg.n_experts  # taken: zeroed
