"""The tiny mixture-of-experts recipe (recipes/moe-tiny-shakespeare.toml) trains on the default
recipe's plays through the real command, and its expert load is watched: experts.jsonl at the
logging cadence, its summary in metrics.jsonl, a heatmap per MoE layer in the report. A router
collapse provoked from step 5 (`model.router_collapse@5+`: every token sent to the same 2 of 8
experts) fires `dead_expert` and `expert_imbalance`; the steps before it fire neither. The same
run balances by bias, so its Qwen3-MoE export is refused in one line."""

from __future__ import annotations

import signal

import pytest
import torch

from tests import readme
from tests.conftest import RECIPES, run_cli, run_cli_error
from trainbook.checkpoint import load_state, tensor_entries
from trainbook.config import load_config
from trainbook.monitor.archive import read_jsonl

STEPS, COLLAPSE = 8, 5
pytestmark = pytest.mark.xdist_group("moe-run")


def _collapse_args(cache) -> list[str]:
    return [str(RECIPES / "moe-tiny-shakespeare.toml"), f"train.max_steps={STEPS}", "log.every_steps=1",
            "train.eval_every=0", "moe.balance=bias", "alerts.expert_records=2", "alerts.expert_imbalance=3.9",
            f"data.cache_dir={cache}"]


@pytest.fixture(scope="module")
def collapsed(tmp_path_factory, shakespeare_cache):
    tmp = tmp_path_factory.mktemp("moe")
    run_dir = tmp / "run"
    done = run_cli("run", *_collapse_args(shakespeare_cache), "--run-dir", str(run_dir), cwd=tmp,
                   env={"TRAINBOOK_FAULT": f"model.router_collapse@{COLLAPSE}+"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir, done.stdout, shakespeare_cache


def test_the_recipe_trains_and_reports_its_expert_load(collapsed):
    run_dir, out, _ = collapsed
    assert "model tiny-moe: 1,790,336 parameters" in out  # the recipe's arithmetic
    assert "compile off (a mixture of experts trains eager for now)" in out
    assert load_config(run_dir / "config.resolved.toml").model.router_bias  # what moe.balance = bias gave it
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert train[COLLAPSE - 2]["loss"] < train[0]["loss"]
    load = read_jsonl(run_dir / "experts.jsonl")
    assert [r["step"] for r in load] == list(range(1, STEPS + 1))
    for record, metrics in zip(load, train):
        assert list(record["layers"]) == ["layers.1", "layers.2", "layers.3"]  # layer 0 is dense
        for v in record["layers"].values():
            assert sum(v["tokens"]) == 2048 * 2  # a step's tokens, 2 choices each
            assert v["imbalance"] == round(max(v["tokens"]) / 512, 4)
        assert metrics["moe_imbalance"] == max(v["imbalance"] for v in record["layers"].values())
        assert metrics["moe_aux_loss"] is None  # balanced by bias
    healthy, broken = load[: COLLAPSE - 1], load[COLLAPSE - 1:]
    assert all(v["idle_frac"] == 0 and v["imbalance"] < 3.9 for r in healthy for v in r["layers"].values())
    for record in broken:  # 2 experts take every token, 6 get none
        assert all(sorted(v["tokens"]) == [0] * 6 + [2048] * 2 for v in record["layers"].values())


def test_a_collapsed_router_fires_the_expert_alerts_and_nothing_before(collapsed):
    run_dir, out, _ = collapsed
    alerts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "alert"]
    fired = {e["rule"]: e for e in alerts}
    assert set(fired) == {"dead_expert", "expert_imbalance"}, alerts
    # two records in a row from step 5: step 6
    assert fired["dead_expert"]["step"] == fired["expert_imbalance"]["step"] == COLLAPSE + 1
    # the experts idle in both records (expert 0 and the one its gate row points at next keep
    # every token; which one that is can change as the weights train)
    load = read_jsonl(run_dir / "experts.jsonl")[COLLAPSE - 1:COLLAPSE + 1]
    dead = sum(a == b == 0 for layer in load[0]["layers"]
               for a, b in zip(load[0]["layers"][layer]["tokens"], load[1]["layers"][layer]["tokens"]))
    assert fired["dead_expert"]["value"] == dead >= 12
    assert fired["expert_imbalance"]["value"] == 4.0  # E / k: every token on the same 2 of 8
    lines = [line for line in out.splitlines() if line.startswith("alert ")]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"alert dead_expert at step {COLLAPSE + 1}: {dead} expert(s) got no token in the "
                               "last 2 logged records"), lines
    assert lines[1].startswith(f"alert expert_imbalance at step {COLLAPSE + 1}: layers.1: expert 0 got 4.00x the mean "
                               "tokens, 2 logged records in a row"), lines
    readme.assert_printed("routers were made to collapse from step 5", out, mask=True)


def test_the_report_draws_each_layers_expert_load(collapsed, tmp_path):
    run_dir, _, _ = collapsed
    out = tmp_path / "report.html"
    done = run_cli("report", str(run_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr
    page = out.read_text(encoding="utf-8")
    assert "<h2>Expert load</h2>" in page
    for layer in (1, 2, 3):
        cells = page.split(f'id="heatmap-experts-layers-{layer}"')[1].split("</svg>")[0]
        assert f'data-cells="{8 * STEPS}"' in page.split(f'id="heatmap-experts-layers-{layer}"')[1][:200]
        assert cells.count('fill="#dddddd"') == 6 * (STEPS - COLLAPSE + 1)  # grey: the dead experts' cells
        assert f"expert 0 step {COLLAPSE:g}:" in cells


def test_a_bias_balanced_qwen3_moe_export_is_refused_in_one_line(collapsed, tmp_path):
    run_dir, _, _ = collapsed
    line = run_cli_error("export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf"), cwd=tmp_path)
    assert "Qwen3MoeForCausalLM routes by a softmax over every expert" in line, line
    assert "router_bias=true (moe.balance = bias trains one)" in line, line


def _weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    """Every model tensor of the run's step-`step` checkpoint, whole, whatever layout wrote it."""
    ckpt = run_dir / "checkpoints" / f"step-{step}"
    shapes = {k.removeprefix("model."): tuple(v.size) for k, v in tensor_entries(ckpt).items() if k.startswith("model.")}
    state = {name: torch.empty(shape) for name, shape in shapes.items()}
    load_state(ckpt, {"model": state})
    return state


def _train(run_dir) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _close(got: list[tuple], expected: list[tuple], rel: float) -> None:
    assert [g[0] for g in got] == [e[0] for e in expected]
    for (_, loss, norm), (step, loss_ref, norm_ref) in zip(got, expected):
        assert loss == pytest.approx(loss_ref, rel=rel) and norm == pytest.approx(norm_ref, rel=rel), step


def test_expert_parallel_ranks_train_and_count_as_one_process_and_resume_in_one(collapsed, shakespeare_cache, tmp_path):
    """parallel.ep = 2 over 2 ranks (experts 0-3 on rank 0, 4-7 on rank 1), micro-batches of 4
    (the same global batch), the same collapse from step 5: every step's tokens per expert equal
    one process's, and so do the selection biases the bias rule moved from them; losses, gradient
    norms and weights agree within the layouts' bounds (tests/dist/test_layouts.py; measured
    here: loss 1.4e-7, gradient norm 3.3e-6, weights 5e-6, the worst in the dense and attention
    weights FSDP shares with every layout). After the collapse both chosen experts of some layer are rank
    0's: rank 1's experts get no token. Its step-4 checkpoint (saved at ep = 2) resumes in one
    process, which trains steps 5-8 as the unbroken single-process run did."""
    run_dir, _, _ = collapsed
    ep = tmp_path / "ep2"
    done = run_cli("run", *_collapse_args(shakespeare_cache), "train.micro_batch_size=4", "parallel.ep=2",
                   "checkpoint.interval_steps=4", "--run-dir", str(ep), "--nproc", "2", cwd=tmp_path,
                   env={"TRAINBOOK_FAULT": f"model.router_collapse@{COLLAPSE}+"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "dp_shard 2 (ep 2)" in done.stdout, done.stdout[:2000]
    one_load, ep_load = (read_jsonl(d / "experts.jsonl") for d in (run_dir, ep))
    assert [r["step"] for r in ep_load] == list(range(1, STEPS + 1))
    for alone, shared in zip(one_load, ep_load):
        assert {k: v["tokens"] for k, v in shared["layers"].items()} == {k: v["tokens"] for k, v in alone["layers"].items()}
        for layer, v in shared["layers"].items():
            assert v["entropy"] == pytest.approx(alone["layers"][layer]["entropy"], abs=2e-4)  # each rounded to 4 places
    idle = [(r["step"], k) for r in ep_load[COLLAPSE - 1:] for k, v in r["layers"].items() if sum(v["tokens"][4:]) == 0]
    assert idle, "no step left rank 1's experts without a token"
    _close(_train(ep), _train(run_dir), rel=1e-5)
    ours, theirs = _weights(ep, STEPS), _weights(run_dir, STEPS)
    assert ours.keys() == theirs.keys()
    biases = [k for k in theirs if k.endswith("expert_bias")]
    assert len(biases) == 3 and all(torch.equal(ours[k], theirs[k]) for k in biases)
    worst = max((((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()).item(), k) for k in theirs)
    assert worst[0] <= 5e-4, worst

    resumed = tmp_path / "resumed"
    done = run_cli("run", *_collapse_args(shakespeare_cache), "--resume", str(ep / "checkpoints" / "step-4"),
                   "--run-dir", str(resumed), cwd=tmp_path, env={"TRAINBOOK_FAULT": f"model.router_collapse@{COLLAPSE}+"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _close(_train(resumed)[-(STEPS - 4):], _train(run_dir)[4:], rel=1e-5)


def test_resuming_a_bias_balanced_checkpoint_without_its_bias_is_one_line(collapsed, shakespeare_cache, tmp_path):
    """The routers' selection bias is part of the model's shape: a recipe without it cannot load
    the checkpoint (set model.router_bias = true to keep it, frozen, with moe.balance = none)."""
    run_dir, _, _ = collapsed
    line = run_cli_error("run", str(RECIPES / "moe-tiny-shakespeare.toml"), "moe.balance=none",
                         f"data.cache_dir={shakespeare_cache}", "--resume", str(run_dir / "checkpoints" / f"step-{STEPS}"),
                         "--run-dir", str(tmp_path / "branch"), cwd=tmp_path)
    assert line.endswith("checkpoint has router_bias=True, recipe has False"), line


def _bias(run_dir) -> dict[str, torch.Tensor]:
    """Every router's selection bias in the run's step-8 checkpoint."""
    return {k: v for k, v in _weights(run_dir, STEPS).items() if k.endswith("router.expert_bias")}


def test_a_killed_bias_balanced_run_resumes_bitwise_with_its_expert_load(collapsed, tmp_path):
    """SIGKILLed after step 6 and resumed from its step-4 checkpoint: every loss and gradient norm,
    every experts.jsonl record and the routers' selection biases at the end equal the straight
    run's bit for bit (the bias is part of the checkpoint; records after step 4 are rewritten)."""
    run_dir, _, cache = collapsed
    killed = tmp_path / "killed"
    done = run_cli("run", *_collapse_args(cache), "checkpoint.interval_steps=4", "--run-dir", str(killed), cwd=tmp_path,
                   env={"TRAINBOOK_FAULT": f"model.router_collapse@{COLLAPSE}+,train.after_step@6"})
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    resumed = run_cli("run", "--run-dir", str(killed), cwd=tmp_path,
                      env={"TRAINBOOK_FAULT": f"model.router_collapse@{COLLAPSE}+"})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "step-4 at step 4" in resumed.stdout

    def series(d):
        train = [(r["step"], r["loss"], r["grad_norm"]) for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "train"]
        return train, [(r["step"], r["layers"]) for r in read_jsonl(d / "experts.jsonl")]

    assert series(killed) == series(run_dir)
    ours, theirs = _bias(killed), _bias(run_dir)
    assert ours.keys() == theirs.keys() and len(ours) == 3
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs) and any(v.abs().sum() > 0 for v in ours.values())
