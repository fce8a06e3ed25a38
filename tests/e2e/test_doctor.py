"""`trainbook doctor` on real runs: each verdict provoked in a real `trainbook run` subprocess."""

import json
import re
from pathlib import Path

import pytest

from tests.conftest import run_cli, run_cli_error, write_corpus, write_recipe


def _train(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("doctor")
    return write_recipe(tmp / "unit.toml", write_corpus(tmp / "corpus"))


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
    assert share > 0.5
    assert "trainbook bench data" in out and "playbook: README.md" in out


def test_a_killed_run_died_after_its_step(recipe):
    run_dir, done = _run(recipe, "killed", env={"TRAINBOOK_FAULT": "train.after_step@3"})
    assert done.returncode != 0
    code, out = _doctor(run_dir)
    assert code == 1, out
    assert out.splitlines()[0] == ("died: the process was killed between steps, after step 3's record "
                                   "(no end marker, no live process)"), out
    assert "last train record: step 3 of 8" in out


def test_a_rank_with_a_slow_source_is_the_straggler(recipe):
    run_dir, done = _run(recipe, "straggler", "--nproc", "2",
                         env={"TRAINBOOK_FAULT": "data.slow_batch@3+", "TRAINBOOK_FAULT_RANK": "1"})
    assert [r["step"] for r in _train(run_dir)] == list(range(1, 9)), done.stderr
    code, out = _doctor(run_dir)
    assert code == 1, out
    assert out.splitlines()[0].startswith("straggler: rank 1 waits for its data longer than rank 0 by "), out
    assert re.search(r"worst: step \d, rank 1 waited [\d.]+ s, rank 0 [\d.]+ s", out), out


def test_not_a_run_directory_is_one_line(tmp_path):
    line = run_cli_error("doctor", str(tmp_path), cwd=tmp_path)
    assert line == f"trainbook: error: {tmp_path}: not a run directory (no config.resolved.toml)"
