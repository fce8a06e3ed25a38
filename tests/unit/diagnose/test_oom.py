"""The OOM breakdown's arithmetic: what a rank holds, which changes plan says fit, the verdict,
and the per-phase attribution of memory growth the leak alert names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import write_recipe
from trainbook.commands.resolve import resolve
from trainbook.diagnose.memory import held_bytes, out_of_memory_error, requested_bytes
from trainbook.diagnose.oom import candidates, judge, verdict
from trainbook.diagnose.phase_memory import retained_by_phase
from trainbook.model import build_model, count
from trainbook.parallel.plan import memory_estimates
from trainbook.runs import RunPaths


def test_the_cpu_allocators_failure_is_recognised_with_its_size():
    try:
        torch.empty(1 << 50, dtype=torch.uint8)  # the real allocator, asked for a PiB
    except RuntimeError as e:
        error = e
    assert out_of_memory_error(error) is error
    assert requested_bytes(error) == 1 << 50
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = error
    assert out_of_memory_error(wrapped) is error
    assert out_of_memory_error(ValueError("shape mismatch")) is None


@pytest.mark.parametrize("overrides", [[], ["model.name=qwen3-tiny", "model.qkv_bias=true"]],
                         ids=["llama", "qwen3-with-biases"])  # q/k norms and biases: tensors of their own
def test_held_bytes_counts_parameters_gradients_and_adam_states(tmp_path, corpus, overrides):
    res = resolve(write_recipe(tmp_path / "unit.toml", corpus), overrides, 1)
    model = build_model(res.cfg.model, "cpu", seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(2, 8, dtype=torch.long)).float().mean().backward()
    optimizer.step()
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    assert n == count(res.cfg.model).total
    held = held_bytes(model, optimizer)
    # fp32 weights and gradients; AdamW: exp_avg, exp_avg_sq and a float32 step per tensor
    assert held == {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n + 4 * tensors, "fsdp_gathered": 0}


@pytest.fixture
def resolved(tmp_path: Path, corpus: Path):
    # micro-batch 4 of 32 tokens, 256 tokens per step: accumulation 2.
    return resolve(write_recipe(tmp_path / "unit.toml", corpus), [], 1)


def test_candidates_keep_the_global_batch(resolved):
    found = candidates(resolved.plan_inputs(), resolved.dims)
    by = {c.overrides: c for c in found}
    assert ("train.activation_checkpoint=selective",) in by and ("train.activation_checkpoint=full",) in by
    for mbs in (2, 1):
        c = by[(f"train.micro_batch_size={mbs}",)]  # the recipe sets global_batch_tokens: it stays
        t = c.inputs.train
        assert t.micro_batch_size * t.seq_len * t.grad_accum_steps(c.dims.dp) * c.dims.dp == 256
    more = by[("parallel.dp_shard=2",)]
    assert more.world_size == 2 and more.dims.dp_shard == 2


def test_verdict_names_the_first_change_plan_says_fits(resolved, tmp_path):
    inputs, dims = resolved.plan_inputs(), resolved.dims
    found = candidates(inputs, dims)
    estimates = memory_estimates([(inputs, dims)] + [(c.inputs, c.dims) for c in found], None)
    current, others = estimates[0], list(zip(found, estimates[1:]))
    now = current["largest"]["total"]
    # A device just too small for the recipe as it is: only what holds less than that can fit.
    capacity = now - 1
    fits = judge(current, others, 0, capacity)
    assert fits, [m["largest"]["total"] for _, m in others]
    assert all(a["estimate_bytes"] <= capacity for a in fits)
    assert [a["overrides"] for a in fits] == [list(c.overrides) for c, m in others if m["largest"]["total"] <= capacity]
    facts = {"step": 3, "rank": 0, "phase": "forward", "block": "block 1", "device": "cpu",
             "requested_bytes": 1 << 20, "alternatives": fits,
             "measured": {"parameters": 10, "gradients": 10, "optimizer": 20, "rss": 1 << 30},
             "plan": {"total": now, "device_memory": capacity}}
    line = verdict(facts, RunPaths.of(tmp_path).oom / "breakdown.json", world_size=1)
    assert line.startswith("out of memory in step 3 (forward, block 1): could not allocate 1 MiB with 1 GiB resident")
    assert line.endswith(f"; try {' '.join(fits[0]['overrides'])} (plan: "
                         f"{_human(fits[0]['estimate_bytes'])}/rank)"), line
    # A request larger than the whole device: no change of layout helps, none is suggested.
    huge = verdict({**facts, "requested_bytes": capacity + 1}, RunPaths.of(tmp_path).oom / "breakdown.json",
                   world_size=1)
    assert "no layout makes it fit" in huge and "try" not in huge


def _human(n: int) -> str:
    from trainbook.sizes import human

    return human(n)


def test_retained_by_phase_tells_kept_from_transient_memory():
    # forward takes 100 (activations) that backward gives back; data keeps 16 for good.
    points = [("data", 116), ("forward", 216), ("backward", 116), ("optimizer", 116)]
    assert retained_by_phase(100, points) == {"data": 16, "forward": 0, "backward": 0, "optimizer": 0}
    # forward keeps 16 of its 116.
    points = [("data", 100), ("forward", 216), ("backward", 116), ("optimizer", 116)]
    assert retained_by_phase(100, points) == {"data": 0, "forward": 16, "backward": 0, "optimizer": 0}
    # Repeated phases (accumulation) add up; a phase that frees more than it took keeps nothing.
    points = [("data", 104), ("forward", 150), ("backward", 104), ("data", 108), ("forward", 160),
              ("backward", 108), ("optimizer", 90)]
    assert retained_by_phase(100, points) == {"data": 0, "forward": 0, "backward": 0, "optimizer": 0}
    shares = retained_by_phase(100, [("data", 90), ("forward", 130), ("backward", 95)])
    assert shares == {"data": 0, "forward": 5, "backward": 0} and sum(shares.values()) == 95 - 90
