"""The GRPO objective (train/grpo.py) in one process on a tiny random Llama: what a rollout trains
(exactly each completion's tokens, with its group's advantage, weights adding up to the
rollout's loss), rollouts repeat for a seed, a reward that raises is an incident, the prompt
order, the reward functions' start-up check, and the sign test: training on a reward raises the
held-out reward, training on its negative lowers it."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from trainbook.config.grpo import GrpoConfig, RewardSpec
from trainbook.config.model import ModelConfig
from trainbook.data.prompts import PromptRecord
from trainbook.errors import TrainbookError
from trainbook.model import build_model
from trainbook.model.sampler import LocalSampler, SamplingParams
from trainbook.parallel.dims import ParallelDims
from trainbook.parallel.runtime import Runtime
from trainbook.train import rl
from trainbook.train.grpo import GrpoObjective, Prompt, StepCycle, Reward, load_rewards

STOP = 1
LOW = 128  # the rewarded tokens: ids below it (a quarter of the vocabulary)
RT = Runtime(0, 1, ParallelDims(1, 1, 1, 1), torch.device("cpu"))


def decode(ids: list[int]) -> str:
    return " ".join(str(i) for i in ids)


def low_share(prompts, completions, **_):
    """The share of a completion's tokens below LOW (an empty completion: None)."""
    out = []
    for c in completions:
        ids = [int(x) for x in c.split()]
        out.append(sum(i < LOW for i in ids) / len(ids) if ids else None)
    return out


def prompts(n: int, seed: int) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(2, 512, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        out.append(Prompt(ids, PromptRecord(decode(ids), {"id": i}, i + 1)))
    return out


def objective(model, cfg: GrpoConfig, fn=low_share, weight=1.0, seed=0, micro=4) -> GrpoObjective:
    reward = Reward("tests:low_share", fn, weight, "grpo.reward[0].function")
    cycle = StepCycle(prompts(32, seed=1), cfg.prompts_per_step, seed)
    return GrpoObjective(cfg, [reward], cycle, LocalSampler(model, batch_size=64), model, RT, micro_batch_size=micro,
                         decode=decode, stop_ids={STOP}, pad_id=0, seed=seed)


def model(seed=0):
    return build_model(ModelConfig(name="debug", max_seq_len=32), "cpu", seed=seed)


CFG = GrpoConfig(reward=[RewardSpec(function="tests:low_share")], group_size=4, prompts_per_step=3, max_new_tokens=6)


def test_a_rollout_trains_each_completion_with_its_groups_advantage():
    policy = model()
    obj = objective(policy, CFG)
    produced = obj.produce(iter(()))
    n = math.ceil(CFG.completions / 4)
    micro = [next(produced) for _ in range(n)]
    last = obj.last
    assert n == 3 and len(last["completions"]) == 12
    rewards = low_share(None, last["completions"])
    assert last["rewards"] == rewards
    advantages, _ = rl.group_advantages(rewards, 4)
    assert torch.equal(torch.cat([b.advantages for b in micro]), advantages)
    # Each row: prompt + completion; the mask marks the completion's targets, stop token included.
    rows = [(b, i) for b in micro for i in range(b.inputs.shape[0])]
    cycle_prompts = obj.prompts.take(0)
    for j, (b, i) in enumerate(rows):
        prompt = cycle_prompts[j // 4].ids
        completion = [int(x) for x in last["completions"][j].split()]
        trained = b.targets[i][b.loss_mask[i]].tolist()
        assert trained[: len(completion)] == completion and len(trained) - len(completion) in (0, 1)
        if len(trained) > len(completion):  # stopped: its stop token is trained too
            assert trained[-1] == STOP
        assert b.inputs[i, : len(prompt)].tolist() == prompt and not b.loss_mask[i, : len(prompt) - 1].any()
    # dapo: every trained token weighs 1 / (the rollout's trained tokens); the weights add to 1.
    total = sum(int(b.loss_mask.sum()) for b in micro)
    assert sum(float(b.weights.sum()) for b in micro) == pytest.approx(1.0)
    assert all(torch.equal(b.weights[b.loss_mask], torch.full((int(b.loss_mask.sum()),), 1 / total)) for b in micro)
    figures = obj.figures()
    assert figures["reward"] == pytest.approx(sum(rewards) / len(rewards))
    assert figures["rewards/low_share/mean"] == figures["reward"]
    assert figures["completions/mean_length"] == pytest.approx(sum(len(c.split()) for c in last["completions"]) / 12)


def test_rollouts_repeat_for_a_seed_and_differ_between_seeds_and_rollouts():
    def rollout(seed, k):
        obj = objective(model(), CFG, seed=seed)
        obj.rollout = k
        produced = obj.produce(iter(()))
        next(produced)
        return obj.last["completions"]

    assert rollout(0, 0) == rollout(0, 0)
    assert rollout(0, 0) != rollout(0, 1)
    assert rollout(0, 0) != rollout(5, 0)


def test_a_reward_that_raises_is_an_incident_not_the_end_of_the_run():
    def broken(prompts, completions, **_):
        raise ValueError("the judge is down")

    policy = model()
    obj = objective(policy, CFG, fn=broken)
    produced = obj.produce(iter(()))
    micro = [next(produced) for _ in range(3)]
    assert obj.incidents == ["step 1: grpo.reward[0].function: tests:low_share raised ValueError: the judge is down"]
    assert obj.last["rewards"] == [None] * 12
    assert all(not b.loss_mask.any() and not b.weights.any() for b in micro)
    loss = sum(obj.loss(policy, b).value for b in micro)
    assert loss.item() == 0.0


def test_a_rollout_scored_in_worker_processes_trains_what_one_scored_here_does(tmp_path, monkeypatch):
    """`reward_workers`: the workers import the function by its path and score the rollout's
    completions in two chunks; the rollout's rewards and what it trains are the same."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "share.py").write_text(f"LOW = {LOW}\n\n" + inspect.getsource(low_share))
    pooled = CFG.model_copy(update={"reward_workers": 2})

    def rollout(cfg):
        obj = objective(model(), cfg)
        obj.rewards = [Reward("share:low_share", low_share, 1.0, "grpo.reward[0].function")]
        micro = obj._rollout(0)
        obj.close()
        return obj.last["rewards"], torch.cat([b.advantages for b in micro]), torch.cat([b.weights for b in micro])

    here, there = rollout(CFG), rollout(pooled)
    assert len(set(here[0])) > 1 and here[0] == there[0]
    assert torch.equal(here[1], there[1]) and torch.equal(here[2], there[2])


def test_the_prompt_order_is_a_permutation_per_epoch_split_over_ranks():
    ps = prompts(6, seed=2)
    whole = StepCycle(ps, 2, seed=3)
    ranks = [StepCycle(ps, 2, seed=3, dp_rank=r, dp=2) for r in range(2)]
    first = [whole.take(k) for k in range(3)]
    assert sorted(p.record.line for rollout in first for p in rollout) == [1, 2, 3, 4, 5, 6]  # one epoch
    assert [ranks[0].take(k) + ranks[1].take(k) for k in range(3)] == first
    second = [p.record.line for k in range(3, 6) for p in whole.take(k)]
    assert sorted(second) == [1, 2, 3, 4, 5, 6] and second != [p.record.line for r in first for p in r]
    with pytest.raises(TrainbookError, match="3 a step do not split over 2"):
        StepCycle(ps, 3, seed=0, dp=2)


def test_reward_functions_are_checked_on_a_dummy_completion_at_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myrewards.py").write_text(
        "def good(prompts, completions, answer, **_):\n    return [1.0 if c == str(answer[0]) else None for c in completions]\n"
        "def two(prompts, completions, **_):\n    return [0.0, 1.0]\n"
        "def text(prompts, completions, **_):\n    return ['high']\n"
        "def positional(prompts):\n    return [0.0]\n")
    sample = PromptRecord("1+1=", {"answer": 2}, 1)

    def error(function):
        cfg = GrpoConfig(reward=[RewardSpec(function="myrewards:good"), RewardSpec(function=function)])
        with pytest.raises(TrainbookError) as e:
            load_rewards(cfg, sample)
        return str(e.value)

    assert [r.name for r in load_rewards(GrpoConfig(reward=[RewardSpec(function="myrewards:good")]), sample)] == ["good"]
    assert error("nowhere:fn") == ("grpo.reward[1].function: cannot import 'nowhere': ModuleNotFoundError: "
                                   "No module named 'nowhere'")
    assert error("myrewards:two") == "grpo.reward[1].function: myrewards:two returned 2 scores for 1 completions"
    assert error("myrewards:text") == ("grpo.reward[1].function: myrewards:text returned 'high' (a str) as score 0, "
                                       "not a finite number or None")
    assert error("myrewards:positional").startswith("grpo.reward[1].function: myrewards:positional raised TypeError")


def held_out_reward(policy) -> float:
    """Mean reward of 4 sampled completions (temperature 1, fixed seeds) of 16 held-out prompts."""
    held = prompts(16, seed=99)
    done = LocalSampler(policy).generate([p.ids for p in held for _ in range(4)], list(range(64)),
                                         SamplingParams(6, temperature=1.0, stop_ids=frozenset({STOP})))
    scores = low_share(None, [decode(c.ids[:-1] if c.stopped else c.ids) for c in done])
    known = [s for s in scores if s is not None]
    return sum(known) / len(known)


def train(weight: float, steps: int = 8) -> float:
    policy = model()
    cfg = GrpoConfig(reward=[RewardSpec(function="tests:low_share")], group_size=8, prompts_per_step=4,
                     max_new_tokens=6)
    obj = objective(policy, cfg, weight=weight)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-2, weight_decay=0.0)
    produced = obj.produce(iter(()))
    for _ in range(steps):
        for _ in range(math.ceil(cfg.completions / 4)):
            micro = obj.loss(policy, next(produced))
            (micro.value / micro.divisor).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return held_out_reward(policy)


def test_training_on_a_reward_raises_it_and_on_its_negative_lowers_it():
    before = held_out_reward(model())
    up, down = train(+1.0), train(-1.0)
    assert math.isclose(before, 0.25, abs_tol=0.1)  # a random policy: about a quarter of the tokens
    assert up > before + 0.25 and down < before - 0.15, (before, up, down)


def half_flat(prompts, completions, id, **_):  # prompts with an even id: every completion scores 1
    shares = low_share(prompts, completions)
    return [1.0 if i % 2 == 0 else s for i, s in zip(id, shares)]


def test_filter_zero_std_with_one_draw_trains_no_token_of_a_group_whose_rewards_are_equal():
    cfg = CFG.model_copy(update={"filter_zero_std": True, "filter_max_draws": 1})
    obj = objective(model(), cfg, fn=half_flat)
    micro = obj._rollout(0)
    flat = [p.record.columns["id"] % 2 == 0 for p in obj.prompts.take(0)]
    assert any(flat) and not all(flat)
    rows = [(b, i) for b in micro for i in range(b.inputs.shape[0])]
    for j, (b, i) in enumerate(rows):
        assert bool(b.loss_mask[i].any()) != flat[j // 4]
    assert sum(float(b.weights.sum()) for b in micro) == pytest.approx(1.0)
    assert obj._rollout_figures["rollout/draws"] == 1


def test_filter_zero_std_draws_more_prompts_until_every_group_tells_its_completions_apart():
    """DAPO's dynamic sampling: the equal-reward groups of the rollout's own prompts are replaced
    by groups of further seeded draws, the same ones on every run; the figures stay the first
    draw's (what the policy scored on the step's prompts)."""
    cfg = CFG.model_copy(update={"filter_zero_std": True})

    def rollout():
        obj = objective(model(), cfg, fn=half_flat)
        micro = obj._rollout(0)
        return obj, micro

    obj, micro = rollout()
    own = [p.record.columns["id"] for p in obj.prompts.take(0)]
    assert any(i % 2 == 0 for i in own)  # the first draw had equal-reward groups
    assert obj._rollout_figures["frac_reward_zero_std"] > 0 and obj._rollout_figures["rollout/draws"] > 1
    assert not any(rl.zero_std_groups(obj.last["rewards"], cfg.group_size))
    assert obj.last["prompts"] != [p.record.prompt for p in obj.prompts.take(0) for _ in range(cfg.group_size)]
    assert all(b.loss_mask[i].any() for b in micro for i in range(b.inputs.shape[0]))
    assert sum(float(b.weights.sum()) for b in micro) == pytest.approx(1.0)
    assert sum(b.inputs.shape[0] for b in micro) == cfg.completions  # the same work a step
    again, _ = rollout()
    assert again.last == obj.last
