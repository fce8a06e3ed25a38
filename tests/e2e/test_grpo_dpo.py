"""GRPO and DPO through the real command, on the chain a user runs: a 3-step `recipes/arith-sft.toml`
run, then `recipes/arith-grpo.toml` and `recipes/arith-dpo.toml` started from it
(`model.init_from = "run:PATH"`). GRPO has a test reward whose scores vary between completions of
even a barely trained model. For each, one uninterrupted 4-step run is the reference: it logs the
objective's figures under TRL's names, and a run killed while sampling a rollout or inside an
update resumes to the same losses, figures and weights, bit for bit. Bad prompts, pairs and reward
functions are one line, exit 2, before any run directory exists."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch

from tests.conftest import CHILD_TIMEOUT_S, RECIPES, run_cli, run_cli_error
from tests.e2e.test_resume import _final_weights, _jsonl
from trainbook.checkpoint import read_latest

REWARDS = '''
def lengths(prompts, completions, answer, **_):
    assert len(prompts) == len(completions) == len(answer)
    return [(len(c) % 3) / 2 for c in completions]


def half_flat(prompts, completions, answer, **_):
    """Every completion of a prompt whose answer is even scores 1: about half the groups are alike."""
    return [1.0 if int(a) % 2 == 0 else (len(c) % 3) / 2 for c, a in zip(completions, answer)]


calls = 0


def flaky(prompts, completions, **_):
    """Raises when scoring step 2's rollout (the start-up checks score one dummy completion)."""
    global calls
    calls += len(completions) > 1
    if calls == 2 and len(completions) > 1:
        raise ConnectionError("the grading server did not answer")
    return [float(len(c) > 2) for c in completions]
'''

FIGURES = ("reward", "reward_std", "rewards/lengths/mean", "rewards/exact_answer/mean", "frac_reward_zero_std",
           "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "completions/mean_length",
           "completions/clipped_ratio", "time/rollout_s", "time/reward_s", "time/reference_s")


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    """The test folder: `sft/` (3 steps of arith-sft), `grpo.toml` (arith-grpo from it, 4 small
    steps, a checkpoint every 2) and `straight/`, its uninterrupted run."""
    tmp = tmp_path_factory.mktemp("grpo")
    sft = ("train.max_steps=3", "train.eval_every=0", "train.compile=false", "run.threads=1")
    done = run_cli("run", str(RECIPES / "arith-sft.toml"), *sft, "--run-dir", str(tmp / "sft"), cwd=tmp,
                   timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (tmp / "myrewards.py").write_text(REWARDS)
    (tmp / "grpo.toml").write_text(f"""
extends = "{RECIPES / 'arith-grpo.toml'}"

[run]
device = "cpu"
threads = 1

[model]
init_from = "run:{tmp / 'sft'}"

[grpo]
group_size = 4
prompts_per_step = 4
filter_zero_std = false       # the recipe's dynamic sampling: its own test below

[[grpo.reward]]
function = "myrewards:lengths"

[[grpo.reward]]
function = "trainbook.rewards:exact_answer"
weight = 0.5

[train]
micro_batch_size = 8          # 16 completions a step: 2 micro-batches
max_steps = 4
compile = false

[optim]
lr = 1e-3

[checkpoint]
interval_steps = 2

[log]
every_steps = 1
""")
    done = run_cli("run", str(tmp / "grpo.toml"), "--run-dir", str(tmp / "straight"), cwd=tmp, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp


def _train(run_dir: Path) -> list[dict]:
    return [r for r in _jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _series(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], *(r[k] for k in FIGURES if not k.startswith("time/")))
            for r in _train(run_dir)]


def test_a_grpo_run_logs_each_reward_and_the_rl_figures_and_trains(chain):
    records = _train(chain / "straight")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert all(k in r for k in FIGURES), sorted(r)
        # A completion's reward is the weighted sum of its functions' (every function scored all).
        assert r["reward"] == pytest.approx(r["rewards/lengths/mean"] + 0.5 * r["rewards/exact_answer/mean"])
        assert 0 < r["completions/mean_length"] <= 6 and 0 <= r["completions/clipped_ratio"] <= 1
        assert r["clip_ratio/low_mean"] == r["clip_ratio/high_mean"] == 0  # one update a rollout: ratio 1
        assert "kl" not in r  # kl_coef 0: no reference, no KL
    assert all(r["grad_norm"] > 0 and r["reward_std"] > 0 for r in records)
    start, end = _final_weights(chain / "sft"), _final_weights(chain / "straight")
    assert any(not torch.equal(start[k], end[k]) for k in start)


@pytest.mark.parametrize("fault", ["grpo.rollout@3", "grpo.update@3"])
def test_a_run_killed_in_a_rollout_or_an_update_resumes_bitwise(chain, tmp_path, fault):
    run_dir = tmp_path / "run"
    killed = run_cli("run", str(chain / "grpo.toml"), "--run-dir", str(run_dir), cwd=chain,
                     env={"TRAINBOOK_FAULT": fault}, timeout=CHILD_TIMEOUT_S)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert read_latest(run_dir / "checkpoints") == 2 and [r["step"] for r in _train(run_dir)] == [1, 2]
    resumed = run_cli("run", "--run-dir", str(run_dir), cwd=chain, timeout=CHILD_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "step-2 at step 2" in resumed.stdout
    # The rollout of step 3 is sampled again from the same weights and seeds: the same
    # completions, rewards, losses and gradients, and the same weights at the end.
    assert _series(run_dir) == _series(chain / "straight")
    ours, theirs = _final_weights(run_dir), _final_weights(chain / "straight")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_bad_prompts_and_rewards_are_one_line_before_any_run_directory(chain):
    recipe = str(chain / "grpo.toml")
    new = str(chain / "never")
    (chain / "bad-reward.toml").write_text('extends = "grpo.toml"\n\n[[grpo.reward]]\nfunction = "myrewards:nowhere"\n')
    line = run_cli_error("run", str(chain / "bad-reward.toml"), "--run-dir", new, cwd=chain)
    assert line == "trainbook: error: grpo.reward[0].function: module 'myrewards' has no 'nowhere'", line
    prompts = (RECIPES / "arith" / "prompts.jsonl").resolve()  # pkg:// resolves inside the package
    line = run_cli_error("run", recipe, "train.seq_len=16", "--run-dir", new, cwd=chain)
    assert f"data.sources[0]: '{prompts}' line 1: the prompt has " in line
    assert "with grpo.max_new_tokens 6 it needs" in line and "more than train.seq_len 16" in line
    line = run_cli_error("run", recipe, "train.eval_every=10", "--run-dir", new, cwd=chain)
    assert line.endswith("train.eval_every: GRPO has no held-out loss: set train.eval_every = 0 and measure the "
                         "held-out reward with `trainbook eval`"), line
    assert not Path(new).exists()


@pytest.mark.parametrize("layout", [("parallel.dp_shard=2",), ("parallel.dp_shard=1", "parallel.tp=2")],
                         ids=["fsdp2", "tp2"])
def test_two_ranks_sample_and_train_as_one_process_does(chain, tmp_path, layout):
    """FSDP: each rank samples half the prompts with its sharded model (every forward of the
    sampler is a collective, so the ranks stop together); TP: both ranks sample the same prompts.
    The completions are the same draws as in one process, so the rewards are equal and the
    losses and gradient norms agree to float tolerance."""
    done = run_cli("run", str(chain / "grpo.toml"), *layout, "--nproc", "2", "--run-dir", str(tmp_path / "two"),
                   cwd=chain, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ours, theirs = _train(tmp_path / "two"), _train(chain / "straight")
    for key in ("reward", "reward_std", "rewards/lengths/mean", "frac_reward_zero_std", "completions/mean_length"):
        assert [r[key] for r in ours] == [r[key] for r in theirs], key
    for key in ("loss", "grad_norm", "entropy"):
        torch.testing.assert_close([r[key] for r in ours], [r[key] for r in theirs], rtol=1e-4, atol=1e-6)


def test_two_fsdp_ranks_refill_the_groups_filter_zero_std_drops(chain, tmp_path):
    """DAPO's dynamic sampling on two sharded ranks: about half of each rollout's groups score
    alike, so the ranks draw more prompts, each as often as the other (a sharded model samples in
    step), and train on groups whose rewards differ."""
    (chain / "refill.toml").write_text('extends = "grpo.toml"\n\n[grpo]\nfilter_zero_std = true\n\n'
                                       '[[grpo.reward]]\nfunction = "myrewards:half_flat"\n')
    run_dir = tmp_path / "refill"
    done = run_cli("run", str(chain / "refill.toml"), "parallel.dp_shard=2", "--nproc", "2", "train.max_steps=2",
                   "checkpoint.interval_steps=0", "--run-dir", str(run_dir), cwd=chain, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = _train(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert any(r["frac_reward_zero_std"] > 0 for r in records)
    assert all(r["rollout/draws"] > 1 for r in records if r["frac_reward_zero_std"] > 0)
    assert all(r["grad_norm"] > 0 for r in records)


def _alerts(run_dir: Path) -> list[dict]:
    return [e for e in _jsonl(run_dir / "events.jsonl") if e["kind"] == "alert"]


def test_a_healthy_run_fires_no_alert(chain):
    assert _alerts(chain / "straight") == []


def test_a_learning_rate_that_wrecks_the_policy_fires_the_rl_alerts(chain, tmp_path):
    """lr 0.1 (100 times the chain's) with a KL term: within 10 steps the policy moves far from the
    reference, its samples collapse onto one answer, the reward it gained is lost, and every group
    then scores alike, so nothing trains. Each of the four rules names it."""
    run_dir = tmp_path / "wrecked"
    done = run_cli("run", str(chain / "grpo.toml"), "optim.lr=0.1", "grpo.kl_coef=0.04", "train.max_steps=10",
                   "checkpoint.interval_steps=0", "--run-dir", str(run_dir), cwd=chain, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    fired = {a["rule"]: a for a in _alerts(run_dir)}
    assert {"kl_blowup", "entropy_collapse", "reward_collapse", "zero_std_groups"} <= set(fired), sorted(fired)
    records = {r["step"]: r for r in _train(run_dir)}
    first = records[1]["entropy"]
    assert fired["entropy_collapse"]["value"] < 0.1 * first
    assert fired["kl_blowup"]["value"] > 1.0 == fired["kl_blowup"]["threshold"]
    at = fired["zero_std_groups"]["step"]
    assert all(records[k]["frac_reward_zero_std"] == 1.0 for k in range(at - 2, at + 1))
    assert "alert entropy_collapse at step" in done.stdout
    # The step each alert names keeps its rollout, the alert's line with it.
    for rule, alert in fired.items():
        kept = json.loads((run_dir / "incidents" / f"step-{alert['step']}" / "rollout-dp0.json").read_text())
        assert {"rule": rule, "message": alert["message"]} in kept["alerts"] and kept["errors"] == []
        assert kept["rollout"] == alert["step"] - 1 and len(kept["completions"]) == len(kept["advantages"]) == 16
        assert kept["rewards"] == [a + 0.5 * b for a, b in zip(kept["rewards_by_function"]["lengths"],
                                                                 kept["rewards_by_function"]["exact_answer"])]
    at = fired["zero_std_groups"]["step"]
    zero = json.loads((run_dir / "incidents" / f"step-{at}" / "rollout-dp0.json").read_text())
    assert set(zero["advantages"]) == {0.0}  # every group alike: nothing trains
    # The post-mortem names the collapse first, with the figures' course and what to change.
    doctor = run_cli("doctor", str(run_dir), cwd=chain)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    verdict = doctor.stdout.splitlines()[0]
    assert verdict.split(":")[0] in ("kl-blowup", "entropy-collapse", "reward-collapse", "no-signal"), verdict
    for kind in ("kl-blowup:", "entropy-collapse:", "reward-collapse:", "no-signal:"):
        assert f"\n{kind}" in doctor.stdout, kind
    assert "  - entropy " in doctor.stdout and "next: a lower optim.lr" in doctor.stdout
    assert "/rollout-dp0.json: that step's rollout (prompts, completions, rewards, advantages)" in doctor.stdout
    assert "reward-errors" not in doctor.stdout  # the alerts' rollouts are not reward errors


def test_doctor_on_a_healthy_grpo_run_shows_the_reward_and_the_rollouts_share(chain):
    """No RL finding (how its time went is the machine's business), the figures' course, and the
    rollout's share of the step apart from waiting for data."""
    doctor = run_cli("doctor", str(chain / "straight"), cwd=chain)
    assert doctor.returncode in (0, 1), doctor.stdout + doctor.stderr
    assert not any(f"\n{k}:" in doctor.stdout for k in ("kl-blowup", "entropy-collapse", "reward-collapse",
                                                          "no-signal", "reward-errors"))
    assert "\nlearning: how the objective's figures moved" in doctor.stdout
    assert "  - reward " in doctor.stdout and "  - completion length " in doctor.stdout
    shares = next(line for line in doctor.stdout.splitlines() if "share of" in line)
    assert "rollout " in shares and "data " in shares  # the rollout is not counted as waiting for data


def test_a_reward_function_that_raises_is_an_incident_with_its_rollout_not_a_crash(chain, tmp_path):
    # Scored in a worker process (`reward_workers`), started from the CLI: the error crosses back.
    (chain / "flaky.toml").write_text('extends = "grpo.toml"\n\n[grpo]\nreward_workers = 1\n\n'
                                      '[[grpo.reward]]\nfunction = "myrewards:lengths"\n\n'
                                      '[[grpo.reward]]\nfunction = "myrewards:flaky"\n')
    run_dir = tmp_path / "flaky"
    done = run_cli("run", str(chain / "flaky.toml"), "train.max_steps=3", "checkpoint.interval_steps=0",
                   "--run-dir", str(run_dir), cwd=chain, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 2: " in done.stdout and "the grading server did not answer" in done.stdout
    assert "incidents/step-2/rollout-dp0.json" in done.stdout
    incident = json.loads((run_dir / "incidents" / "step-2" / "rollout-dp0.json").read_text())
    assert len(incident["prompts"]) == len(incident["completions"]) == 16 and incident["rollout"] == 1
    assert incident["rewards_by_function"]["flaky"] == [None] * 16
    assert incident["rewards_by_function"]["lengths"] == [(len(c) % 3) / 2 for c in incident["completions"]]
    assert "ConnectionError: the grading server did not answer" in incident["errors"][0]
    assert sorted(p.name for p in (run_dir / "incidents").iterdir()) == ["step-2"]  # steps 1 and 3 scored
    records = _train(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert math.isnan(records[1]["rewards/flaky/mean"]) and not math.isnan(records[2]["rewards/flaky/mean"])


# ---- DPO ------------------------------------------------------------------------------------

DPO_FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
               "logps/rejected")


@pytest.fixture(scope="module")
def dpo(chain) -> Path:
    """`dpo.toml` (arith-dpo from the chain's SFT run, a frozen reference, 8 pairs a step in 2
    micro-batches, 4 steps, a checkpoint every 2) and `dpo-straight/`, its uninterrupted run."""
    (chain / "dpo.toml").write_text(f"""
extends = "{RECIPES / 'arith-dpo.toml'}"

[run]
device = "cpu"
threads = 1

[model]
init_from = "run:{chain / 'sft'}"

[dpo]
pairs_per_step = 8
reference = "frozen"

[train]
micro_batch_size = 4
max_steps = 4
compile = false

[optim]
lr = 1e-3

[checkpoint]
interval_steps = 2

[log]
every_steps = 1
""")
    done = run_cli("run", str(chain / "dpo.toml"), "--run-dir", str(chain / "dpo-straight"), cwd=chain,
                   timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return chain


def _dpo_series(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], *(r[k] for k in DPO_FIGURES)) for r in _train(run_dir)]


def test_a_dpo_run_starts_at_ln2_logs_trl_figures_and_trains(dpo):
    records = _train(dpo / "dpo-straight")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    first = records[0]  # the policy is the reference: every margin is 0
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0
    for r in records:
        assert 0 <= r["rewards/accuracies"] <= 1 and r["logps/chosen"] < 0 and r["logps/rejected"] < 0
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"])
    assert any(r["rewards/margins"] != 0 for r in records[1:])
    start, end = _final_weights(dpo / "sft"), _final_weights(dpo / "dpo-straight")
    assert any(not torch.equal(start[k], end[k]) for k in start)


def test_a_dpo_run_killed_inside_a_step_resumes_bitwise(dpo, tmp_path):
    run_dir = tmp_path / "run"
    killed = run_cli("run", str(dpo / "dpo.toml"), "--run-dir", str(run_dir), cwd=dpo,
                     env={"TRAINBOOK_FAULT": "dpo.update@3"}, timeout=CHILD_TIMEOUT_S)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert read_latest(run_dir / "checkpoints") == 2 and [r["step"] for r in _train(run_dir)] == [1, 2]
    resumed = run_cli("run", "--run-dir", str(run_dir), cwd=dpo, timeout=CHILD_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert _dpo_series(run_dir) == _dpo_series(dpo / "dpo-straight")
    ours, theirs = _final_weights(run_dir), _final_weights(dpo / "dpo-straight")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_two_fsdp_ranks_train_dpo_as_one_process_does(dpo, tmp_path):
    """Each rank trains half of a step's pairs; the loss is the mean over all of them."""
    done = run_cli("run", str(dpo / "dpo.toml"), "parallel.dp_shard=2", "--nproc", "2", "--run-dir",
                   str(tmp_path / "two"), cwd=dpo, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ours, theirs = _train(tmp_path / "two"), _train(dpo / "dpo-straight")
    for key in ("loss", "grad_norm", *DPO_FIGURES):
        torch.testing.assert_close([r[key] for r in ours], [r[key] for r in theirs], rtol=1e-4, atol=1e-6)


def test_a_bad_pair_is_one_line_before_any_run_directory(dpo):
    (dpo / "pairs.jsonl").write_text('{"prompt": [{"role": "user", "content": "1+1"}], '
                                     '"chosen": [{"role": "assistant", "content": "2"}]}\n')
    (dpo / "bad-pairs.toml").write_text('extends = "dpo.toml"\n\n[[data.sources]]\nname = "mine"\n'
                                        'paths = ["pairs.jsonl"]\nformat = "preference"\n')
    new = dpo / "never"
    line = run_cli_error("run", str(dpo / "bad-pairs.toml"), "--run-dir", str(new), cwd=dpo)
    assert "pairs.jsonl' line 1: no field 'rejected'" in line, line
    line = run_cli_error("run", str(dpo / "dpo.toml"), "dpo.reference=adapter_off", "--run-dir", str(new), cwd=dpo)
    assert line.endswith("dpo.reference: reference 'adapter_off' is the policy with its LoRA adapters off: add "
                         "[lora], or use 'frozen' or 'precompute'"), line
    assert not new.exists()


def test_the_report_plots_the_objectives_figures(dpo, tmp_path):
    """`trainbook report` of the GRPO and DPO runs: reward (each function's too), entropy and
    completion length; DPO's implicit rewards and accuracy, each drawn in a real browser."""
    from tests.e2e.test_reports import _assert_clean_and_drawn, render

    expected = {
        "straight": {"chart-reward": {"reward", "lengths", "exact_answer"}, "chart-entropy": {"entropy"},
                     "chart-completion-length": {"tokens"}},
        "dpo-straight": {"chart-preference": {"margin", "chosen", "rejected"}, "chart-accuracy": {"accuracy"}},
    }
    for name, charts in expected.items():
        done = run_cli("report", str(dpo / name), cwd=dpo)
        assert done.returncode == 0, done.stderr
        page = dpo / name / "report.html"
        drawn = _assert_clean_and_drawn(render(page, tmp_path / f"{name}.png"), page, tmp_path / f"{name}.png")
        for cid, series in charts.items():
            assert {s["name"] for s in drawn[cid]["series"]} == series, (name, cid)
            assert all(s["points"] == 4 for s in drawn[cid]["series"])
        others = set(expected) - {name}
        assert not any(cid in drawn for other in others for cid in expected[other])
