"""The straggler alert, proven in real 2-rank runs (`trainbook run --nproc 2`, gloo).

Rank 1's data is slowed by the `data.slow_batch` fault point (trainbook/faults.py): from a step
on, its first batch arrives 9 times the median of its clean steps late, so the slowdown is large
against the step on any machine, and the test asserts no times.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from tests.conftest import prepared_recipe, run_cli
from trainbook.config.monitor import ALERT_RULES

pytestmark = pytest.mark.slow

QUICK = ("train.eval_every=0", "--nproc", "2")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, debug_data) -> Path:
    """The debug recipe over the session's prepared data, for every run in this module."""
    return prepared_recipe(tmp_path_factory.mktemp("stragglers"), debug_data)


def _stragglers(recipe: Path, run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> list[dict]:
    done = run_cli("run", str(recipe), *overrides, *QUICK, "--run-dir", str(run_dir), cwd=recipe.parent, env=env)
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["kind"] == "alert" and e["rule"] == "straggler"]


def test_a_rank_with_slow_data_is_the_straggler(recipe, tmp_path):
    # Every step logged, probed on every 2nd (2, 4, 6, 8): slow from step 4, so the third slow
    # probed interval in a row is step 8 (probing every logged step, it would be step 6).
    alerts = _stragglers(recipe, tmp_path / "slow", "train.max_steps=8", "log.every_steps=1", "alerts.straggler_every=2",
                         env={"TRAINBOOK_FAULT": "data.slow_batch@4+", "TRAINBOOK_FAULT_RANK": "1"})
    assert [a["step"] for a in alerts] == [8], alerts  # once: repeat_after_s (300 s) holds the rest back
    alert = alerts[0]
    assert re.fullmatch(r"rank 1 \(host (\S+)\) is the straggler for 3 probed intervals: the others wait "
                        r"[\d.]+ s a step for it; its time goes to data loading \(data [\d.]+ s vs median [\d.]+ s\)",
                        alert["message"]), alert["message"]
    assert f"(host {socket.gethostname()})" in alert["message"]
    assert alert["value"] > alert["threshold"] > 0
    # The data figures it quotes: rank 1's data phase is most of the wait it causes.
    data, median = map(float, re.search(r"data ([\d.]+) s vs median ([\d.]+) s", alert["message"]).groups())
    assert data > 5 * median and data > alert["value"] / 2, alert


@pytest.fixture(scope="module")
def clean(recipe, tmp_path_factory) -> tuple[Path, list[dict]]:
    """24 steps, every one logged and every 4th probed (the default): the run dir and its
    straggler alerts."""
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    return run_dir, _stragglers(recipe, run_dir, "train.max_steps=24", "log.every_steps=1")


def test_a_clean_run_has_no_straggler(clean):
    # 6 probed intervals judged, none with a rank the others wait for.
    assert clean[1] == []


def test_the_probes_change_no_number(recipe, clean, tmp_path):
    """The same run with the straggler rule off (no probe at all), its first 8 steps: every loss
    and gradient norm bitwise equal to the probed run's."""
    off_rules = "alerts.rules=[" + ", ".join(f'"{r}"' for r in ALERT_RULES if r != "straggler") + "]"
    assert _stragglers(recipe, tmp_path / "off", "train.max_steps=24", "train.stop_at_step=8", "log.every_steps=1",
                       off_rules) == []
    off = _train_records(tmp_path / "off")
    on = _train_records(clean[0])[:8]
    assert [r["step"] for r in off] == list(range(1, 9))
    assert [(r["loss"], r["grad_norm"]) for r in off] == [(r["loss"], r["grad_norm"]) for r in on]


def _train_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"]
