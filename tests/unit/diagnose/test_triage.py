"""The spike rule and the module locator of NaN triage (diagnose/triage.py), on real tensors."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainbook.diagnose.triage import Locator, SpikeRule


def _fed(rule: SpikeRule, losses, lr: float = 1.0) -> SpikeRule:
    for loss in losses:
        rule.accept(loss, lr)
    return rule


def test_spikes_are_judged_only_after_the_warmup_and_a_full_window():
    rule = SpikeRule(z=6.0, window=5)
    for step, lr in enumerate([0.1, 0.2, 0.3]):  # warmup: LR rising, no judgement
        assert rule.check(50.0, lr) is None
        rule.accept(3.0 - 0.01 * step, lr)
    _fed(rule, [2.9, 2.89, 2.88, 2.87], lr=0.3)
    assert rule.check(50.0, 0.3) is None  # 4 steps since the warmup: not a full window yet
    _fed(rule, [2.86], lr=0.3)
    spike = rule.check(50.0, 0.3)
    assert spike is not None and spike.kind == "spike" and spike.z > 6 and math.isclose(spike.expected, 2.85, abs_tol=0.01)
    assert rule.check(2.86, 0.3) is None  # on the trend
    assert rule.check(2.95, 0.3) is None  # 3% above the trend: within the 1%-of-level floor's 6 sigmas


def test_a_falling_loss_is_a_trend_not_a_spike():
    rule = _fed(SpikeRule(z=6.0, window=8), [6.0 - 0.3 * i for i in range(10)])
    assert rule.check(6.0 - 0.3 * 10, 1.0) is None
    assert rule.check(6.0 - 0.3 * 10 + 1.0, 1.0) is not None  # a rise of 1.0 against a falling trend


class _Poisoned(nn.Module):
    def forward(self, x):
        return x * float("nan")


class _GradPoison(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class _BadBackward(nn.Module):
    def forward(self, x):
        return _GradPoison.apply(x)


def _run(model: nn.Module) -> Locator:
    with Locator(model, active=lambda: True) as locator:
        model(torch.ones(2, 4, requires_grad=True)).sum().backward()
    return locator


def test_the_first_module_whose_output_is_nonfinite_is_named():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), _Poisoned()), nn.Linear(4, 1))
    located = _run(model)
    assert located.forward[0] == 0 and located.forward[2] == "1.1"  # the poisoner, before its parent "1"


def test_a_nonfinite_gradient_is_found_in_backward_when_outputs_are_finite():
    model = nn.Sequential(nn.Linear(4, 4), _BadBackward(), nn.Linear(4, 1))
    located = _run(model)
    assert located.forward is None
    assert located.backward[2] == "0"  # the gradient flowing back into module 0's output is inf
    assert not any(h for h in located._hooks)  # hooks removed on exit


def test_a_nan_in_a_qwen3_query_norm_is_named_by_its_module_path():
    """A real decoder of the Qwen3 family, a NaN put in one block's q_norm gain: the locator names
    that module (inside attention, before RoPE), not its block or the attention around it."""
    from trainbook.config.model import ModelConfig
    from trainbook.model import build_model

    model = build_model(ModelConfig(name="qwen3-tiny", n_layers=2, vocab_size=64), "cpu", seed=0)
    with torch.no_grad():
        model.layers["1"].attention.q_norm.weight[3] = float("nan")
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with Locator(model, active=lambda: True) as located:
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    assert located.forward[2] == "layers.1.attention.q_norm"
