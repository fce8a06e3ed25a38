"""`trainbook doctor` on real runs: each verdict provoked in a real `trainbook run` subprocess."""

import json
import re
import shutil
from pathlib import Path

import pytest

from tests import readme
from tests.conftest import prepared_recipe, run_cli, run_cli_error

pytestmark = pytest.mark.slow


def _train(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, debug_data) -> Path:
    return prepared_recipe(tmp_path_factory.mktemp("doctor"), debug_data)


def _run(recipe: Path, name: str, *args: str, env: dict | None = None):
    run_dir = recipe.parent / name
    done = run_cli("run", str(recipe), "train.max_steps=8", "log.every_steps=1", "train.eval_every=0",
                   *args, "--run-dir", str(run_dir), cwd=recipe.parent, env=env)
    return run_dir, done


def _doctor(run_dir: Path):
    done = run_cli("doctor", str(run_dir))
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout


def test_a_plain_run_is_healthy_and_compute_bound(recipe):
    run_dir, done = _run(recipe, "plain")
    assert done.returncode == 0, done.stderr
    code, out = _doctor(run_dir)
    assert code == 0, out
    first = out.splitlines()[0]
    assert first.startswith("healthy; compute-bound: forward + backward + optimizer "), out
    assert int(re.search(r"(\d+)% of step time", first)[1]) >= 50


def test_a_slow_source_is_data_bound_with_the_data_wait_share(recipe):
    run_dir, done = _run(recipe, "slow", env={"TRAINBOOK_FAULT": "data.slow_batch@3+"})
    assert done.returncode == 0, done.stderr
    code, out = _doctor(run_dir)
    assert code == 1, out
    first = out.splitlines()[0]
    assert first.startswith("data-bound: waiting for data "), out
    # The share quoted is the run's own: steps 2-7 (the start-up step and the final save left out).
    steady = [r for r in _train(run_dir) if 2 <= r["step"] <= 7]
    share = sum(r["phases"]["data"] for r in steady) / sum(r["step_time_s"] for r in steady)
    assert int(re.search(r"(\d+)% of step time", first)[1]) == round(share * 100), (share, out)
    assert "trainbook bench data" in out and "playbook: README.md" in out
    readme.assert_printed("A slow input path", out, command="trainbook doctor", mask=True, replace={str(run_dir): "runs/slow"})


def test_a_slow_link_is_communication_bound(recipe):
    """Rank 1's loss report (the step's last exposed collective) joins 9 clean steps late from step
    3 on: both ranks wait in grad_sync, neither in its data or compute."""
    run_dir, done = _run(recipe, "slow-link", "--nproc", "2",
                         env={"TRAINBOOK_FAULT": "comm.slow_sync@3+", "TRAINBOOK_FAULT_RANK": "1"})
    assert done.returncode == 0, done.stderr
    code, out = _doctor(run_dir)
    assert code == 1, out
    first = out.splitlines()[0]
    assert first.startswith("communication-bound: exposed gradient communication (grad_sync) "), out
    steady = [r for r in _train(run_dir) if 3 <= r["step"] <= 7]
    assert all(r["phases"]["grad_sync"] > r["phases"]["data"] for r in steady), steady
    # The remedy for FSDP's traffic, with what it would send: half the fp32 gradient, per pass.
    sizes = re.search(r'parallel.reduce_dtype = "bf16" \(each pass\'s gradient reduce-scatter: ([\d.]+) (\w+) -> '
                      r'([\d.]+) (\w+) per rank\)', out)
    assert sizes, out
    assert sizes[2] == sizes[4] and float(sizes[1]) / float(sizes[3]) == pytest.approx(2, rel=0.01), sizes[0]


@pytest.fixture(scope="module")
def killed(recipe) -> Path:
    """A run SIGKILLed between steps 3 and 4 (the died verdict; the renamed-key cases copy it)."""
    run_dir, done = _run(recipe, "killed", env={"TRAINBOOK_FAULT": "train.after_step@3"})
    assert done.returncode == -9, done.stderr
    return run_dir


def test_a_killed_run_died_after_its_step(killed):
    run_dir = killed
    code, out = _doctor(run_dir)
    assert code == 1, out
    assert out.splitlines()[0] == ("died: the process was killed between steps, after step 3's record "
                                   "(no end marker, no live process)"), out
    assert "last train record: step 3 of 8" in out
    readme.assert_printed("A run killed by SIGKILL after step 3", out, mask=True)


def test_a_rank_with_a_slow_source_is_the_straggler(slow_data_pair):
    # The session's 2-rank run whose rank 1's data is slow from step 4 (tests/conftest.py).
    run_dir = slow_data_pair.run_dir
    assert [r["step"] for r in _train(run_dir)] == list(range(1, 9)), slow_data_pair.done.stderr
    code, out = _doctor(run_dir)
    assert code == 1, out
    assert out.splitlines()[0].startswith("straggler: rank 1 waits for its data longer than rank 0 by "), out
    assert re.search(r"worst: step \d, rank 1 waited [\d.]+ s, rank 0 [\d.]+ s", out), out
    readme.assert_printed("Rank 1 of two slowed from step 4", out, mask=True)


def test_not_a_run_directory_is_one_line(tmp_path):
    line = run_cli_error("doctor", str(tmp_path), cwd=tmp_path)
    assert line == f"trainbook: error: {tmp_path}: not a run directory (no config.resolved.toml)"


def _renamed(run_dir: Path, copy: Path, file: str, key: str) -> Path:
    """A copy of a real run directory in which one key of `file` is renamed (every JSON line of it)."""
    shutil.copytree(run_dir, copy)
    lines = (copy / file).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for r in records:
        r[f"{key}_renamed"] = r.pop(key)
    (copy / file).write_text("".join(json.dumps(r) + "\n" for r in records))
    return copy


def test_a_run_that_raises_failed_and_its_checkpoints_bound_it(recipe):
    # A real Python error at the first batch of step 6; a synchronous save after every step.
    run_dir, done = _run(recipe, "raises", "checkpoint.interval_steps=1", "checkpoint.keep_last=2",
                         env={"TRAINBOOK_FAULT": "data.next_batch@6", "TRAINBOOK_FAULT_ACTION": "raise"})
    assert done.returncode == 1, done.stderr
    code, out = _doctor(run_dir)
    assert code == 1, out
    assert out.splitlines()[0] == ("failed: the run stopped with an error at step 5: RuntimeError: fault "
                                   "injected at data.next_batch (step 6)"), out
    assert "health.json: step 6, phase data, pid " in out and "last train record: step 5 of 8" in out, out
    assert "newest checkpoint: checkpoints/step-5 (a resume starts there)" in out, out
    # How the time went comes after the failure: the saves block more than their share.
    assert re.search(r"\ncheckpoint-bound: checkpoint blocking \d+% of step time\n", out), out
    assert "next: checkpoint.mode=async, or a longer checkpoint.interval_steps" in out


def test_a_renamed_key_in_a_real_run_is_one_line_naming_file_and_key(killed, tmp_path):
    run_dir = killed
    health = _renamed(run_dir, tmp_path / "health", "health.json", "phase")
    line = run_cli_error("doctor", str(health), cwd=tmp_path / "health")
    assert line == (f"trainbook: error: {health / 'health.json'}: phase: missing (written by another version of "
                    "trainbook, or damaged): doctor cannot judge the run without it"), line
    metrics = _renamed(run_dir, tmp_path / "metrics", "metrics.jsonl", "step_time_s")
    line = run_cli_error("doctor", str(metrics), cwd=tmp_path / "metrics")
    assert line.startswith(f"trainbook: error: {metrics / 'metrics.jsonl'} (train record of step 1): step_time_s: "
                           "missing "), line
