"""The phase profile on the embedded default recipe: the parts of every step add up to its time,
and `train.profile_steps` leaves a Chrome trace with the ops and the phases named."""

import json

import pytest

from tests.conftest import RECIPES, run_cli, run_cli_error

DEFAULT = str(RECIPES / "tiny-shakespeare.toml")
PHASES = {"data", "forward", "backward", "grad_sync", "optimizer", "checkpoint", "eval"}


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory, shakespeare_cache):
    tmp = tmp_path_factory.mktemp("phases")
    run_dir = tmp / "run"
    done = run_cli("run", DEFAULT, f"data.cache_dir={shakespeare_cache}", "train.max_steps=6", "log.every_steps=1",
                   "train.eval_every=3", "train.eval_steps=2", "checkpoint.interval_steps=3",
                   "train.profile_phases=true", "train.profile_steps=[2,3]", "--run-dir", str(run_dir), cwd=tmp)
    assert done.returncode == 0, done.stderr
    return run_dir


def test_the_phases_add_up_to_the_step_time(profiled_run):
    train = [json.loads(line) for line in (profiled_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:
        assert set(r["phases"]) == PHASES
        assert abs(sum(r["phases"].values()) - r["step_time_s"]) <= 0.05 * r["step_time_s"], r
        # The training throughput leaves out the evaluation and checkpoint the record covers.
        train_s = r["step_time_s"] - r["phases"]["eval"] - r["phases"]["checkpoint"]
        assert r["tokens_per_s"] == pytest.approx(2048 / train_s, rel=1e-6)
    by_step = {r["step"]: r["phases"] for r in train}
    # The evaluation and checkpoint after steps 3 and 6 are in those steps' records, no other.
    assert all(by_step[s]["eval"] > 0 and by_step[s]["checkpoint"] > 0 for s in (3, 6))
    assert all(by_step[s]["eval"] == 0 for s in (1, 2, 4, 5))
    assert all(by_step[s]["forward"] > 0 and by_step[s]["backward"] > 0 for s in by_step)


def test_profile_steps_write_a_chrome_trace_with_ops_and_phases(profiled_run):
    traces = sorted(p.name for p in (profiled_run / "profile").iterdir())
    assert traces == ["rank0-steps-2-3.json"]
    events = json.loads((profiled_run / "profile" / traces[0]).read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"aten::mm", "aten::addmm"} & names  # the model's matmuls
    assert {"phase/data", "phase/forward", "phase/backward", "phase/optimizer", "phase/evaluation",
            "phase/checkpoint"} <= names, sorted(n for n in names if n.startswith("phase/"))


@pytest.mark.parametrize("value, says", [
    ("[5, 3]", "train.profile_steps: [5, 3] is not [first, last] with 1 <= first <= last"),
    ("[2, 9]", "profile_steps [2, 9] ends after train.max_steps = 6"),
])
def test_profile_steps_out_of_range_is_one_line(tmp_path, value, says):
    line = run_cli_error("run", DEFAULT, "train.max_steps=6", f"train.profile_steps={value}",
                         "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert says in line, line
