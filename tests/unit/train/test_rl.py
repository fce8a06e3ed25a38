"""The arithmetic of GRPO and DPO (train/rl.py) against hand computations: advantages, the
clipped loss and its gradient, k3, the loss aggregations, sequence log-probabilities and the DPO
loss. Each test names the mistake it catches."""

from __future__ import annotations

import math

import pytest
import torch

from trainbook.config.model import ModelConfig
from trainbook.model import build_model
from trainbook.train.rl import (
    ADVANTAGE_EPS, clipped_surrogate, dpo_loss, group_advantages, k3, sequence_logprobs, token_entropy,
    token_logprobs, token_weights, total_rewards, zero_std_groups,
)


def test_advantages_of_a_group_use_bessels_std():
    """[1, 0, 0, 1]: mean 0.5, std sqrt(1/3) (n - 1 in the variance; n would give 0.5 and +-1)."""
    adv, scored = group_advantages([1, 0, 0, 1], group_size=4)
    expected = 0.5 / (math.sqrt(1 / 3) + ADVANTAGE_EPS)
    torch.testing.assert_close(adv, torch.tensor([expected, -expected, -expected, expected]), rtol=0, atol=1e-6)
    assert abs(expected - 0.8660) < 2e-4 and scored.all()


def test_a_group_of_equal_rewards_has_zero_advantages_and_groups_are_separate():
    adv, _ = group_advantages([2, 2, 2, 2, 1, 0, 0, 1], group_size=4)
    assert adv[:4].tolist() == [0.0] * 4
    assert adv[4] > 0.86 and adv[5] < -0.86  # the second group on its own statistics
    assert zero_std_groups([2, 2, 2, 2, 1, 0, 0, 1], 4) == [True, False]
    assert zero_std_groups([1, None, 0, 0], 2) == [True, True]


def test_a_none_reward_is_left_out_of_its_groups_statistics():
    """[1, None, 0, 1]: mean 2/3 and std over the three scored (counting None as 0 would give
    mean 1/2); the unscored completion gets 0 and trains nothing."""
    adv, scored = group_advantages([1, None, 0, 1], group_size=4)
    std = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    up, down = (1 / 3) / (std + ADVANTAGE_EPS), (-2 / 3) / (std + ADVANTAGE_EPS)
    torch.testing.assert_close(adv, torch.tensor([up, 0.0, down, up]), rtol=0, atol=1e-6)
    assert scored.tolist() == [True, False, True, True]


def test_batch_and_no_scaling():
    rewards = [1.0, 0.0, 3.0, 5.0]
    adv, _ = group_advantages(rewards, group_size=2, scale="batch")
    std = torch.tensor(rewards, dtype=torch.float64).std().item()
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -1.0, 1.0]) / (std + ADVANTAGE_EPS), rtol=0, atol=1e-6)
    adv, _ = group_advantages(rewards, group_size=2, scale="none")
    assert adv.tolist() == [0.5, -0.5, -1.0, 1.0]


def test_total_rewards_weigh_each_function_and_skip_none():
    assert total_rewards([[1.0, None, None], [0.5, 0.5, None]], [1.0, 2.0]) == [2.0, 1.0, None]


@pytest.fixture(scope="module")
def policy():
    return build_model(ModelConfig(name="debug", max_seq_len=16), "cpu", seed=0)


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (3, 9), generator=g)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, 3:] = True
    mask[1, 5:7] = True
    mask[2, 2:] = True
    return tokens[:, :-1], tokens[:, 1:], mask, torch.tensor([1.5, -0.5, 0.7])


def test_one_update_per_rollout_is_reinforce(policy):
    """With the old log-probs those of the policy itself (the ratio is 1), the clipped loss's
    gradient is REINFORCE's: -A x grad log p, token-weighted (a ratio taken against something
    else, or a clip applied at 1, would change it)."""
    inputs, targets, mask, adv = _batch()
    weights = token_weights(mask, "dapo", sequences=3, tokens=int(mask.sum()), max_new_tokens=8)

    def grads(loss_of):
        policy.zero_grad(set_to_none=True)
        logp = token_logprobs(policy(inputs), targets)
        loss_of(logp).backward()
        return {k: p.grad.clone() for k, p in policy.named_parameters()}

    clipped = grads(lambda logp: (clipped_surrogate(logp, logp.detach(), adv, 0.2, 0.28)[0] * weights).sum())
    reinforce = grads(lambda logp: -(adv[:, None] * logp * weights).sum())
    for k in clipped:
        torch.testing.assert_close(clipped[k], reinforce[k], rtol=0, atol=1e-7, msg=k)
    assert any(g.abs().max() > 0 for g in clipped.values())


def test_clipped_tokens_have_zero_gradient():
    """A second update on the same rollout: where the ratio left the clip range in the direction
    of the advantage, the token's gradient is exactly 0; elsewhere it is not."""
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.5, 0.1, -0.5], [0.5, -0.1, -0.5]], requires_grad=True)  # ratios e^0.5, ..., e^-0.5
    adv = torch.tensor([1.0, -1.0])
    loss, low, high = clipped_surrogate(logp, old, adv, clip_low=0.2, clip_high=0.28)
    loss.sum().backward()
    assert high.tolist() == [[True, False, False], [False, False, False]]
    assert low.tolist() == [[False, False, False], [False, False, True]]
    assert logp.grad[0, 0] == 0 and logp.grad[1, 2] == 0
    # Unclipped, or clipped against the advantage (min takes the unclipped side): a gradient.
    assert (logp.grad[0, 1:] != 0).all() and (logp.grad[1, :2] != 0).all()


def test_k3_is_nonnegative_and_flat_at_the_reference():
    g = torch.Generator().manual_seed(1)
    logp, ref = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    assert (k3(logp, ref) >= 0).all()
    same = torch.randn(50, generator=g)
    at = same.clone().requires_grad_(True)
    value = k3(at, same)
    value.sum().backward()
    assert value.eq(0).all() and at.grad.eq(0).all()


def test_lengths_1_and_10_tell_the_aggregations_apart():
    """Sequence 1 has one completion token of loss a, sequence 2 ten of loss b."""
    a, b = 3.0, 1.0
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 0] = True
    mask[1, :] = True
    per_token = torch.where(torch.arange(2)[:, None] == 0, a, b).expand(2, 10)
    agg = {name: (per_token * token_weights(mask, name, sequences=2, tokens=11, max_new_tokens=10)).sum().item()
           for name in ("dapo", "grpo", "dr_grpo")}
    assert agg["dapo"] == pytest.approx((a + 10 * b) / 11)
    assert agg["grpo"] == pytest.approx((a + b) / 2)
    assert agg["dr_grpo"] == pytest.approx((a + 10 * b) / 20)


def test_sequence_logprobs_leave_the_prompt_out(policy):
    inputs, targets, mask, _ = _batch()
    with torch.no_grad():
        logits = policy(inputs)
    total = sequence_logprobs(logits, targets, mask)
    by_hand = torch.log_softmax(logits, dim=-1).gather(2, targets[..., None])[..., 0]
    torch.testing.assert_close(total, (by_hand * mask).sum(1), rtol=0, atol=1e-5)
    changed = logits.clone()
    changed[:, :2] += torch.randn_like(changed[:, :2])  # the prompt positions of every row
    assert torch.equal(sequence_logprobs(changed, targets, mask), total)
    torch.testing.assert_close(token_entropy(logits), torch.distributions.Categorical(logits=logits).entropy(),
                               rtol=0, atol=1e-5)


def test_dpo_loss_is_ln2_at_the_reference_and_matches_a_hand_computation():
    same = torch.tensor([-5.0, -12.0])
    loss, chosen, rejected = dpo_loss(same, same - 1, same, same - 1, beta=0.1)
    torch.testing.assert_close(loss, torch.full((2,), math.log(2)), rtol=0, atol=1e-7)
    assert chosen.eq(0).all() and rejected.eq(0).all()
    # logp chosen -5 (ref -6), rejected -7 (ref -6): margin 2, beta 0.1.
    pc, pr, rc, rr = (torch.tensor([x]) for x in (-5.0, -7.0, -6.0, -6.0))
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=0.1)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.2)))
    assert chosen.item() == pytest.approx(0.1) and rejected.item() == pytest.approx(-0.1)
    smoothed, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.1)
    assert smoothed.item() == pytest.approx(0.9 * math.log1p(math.exp(-0.2)) + 0.1 * math.log1p(math.exp(0.2)))
