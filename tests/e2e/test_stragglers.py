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

pytestmark = pytest.mark.slow

QUICK = ("train.eval_every=0", "--nproc", "2")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    """The debug recipe with its data prepared once for both runs."""
    return prepared_recipe(tmp_path_factory.mktemp("stragglers"))


def _stragglers(recipe: Path, run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> list[dict]:
    done = run_cli("run", str(recipe), *overrides, *QUICK, "--run-dir", str(run_dir), cwd=recipe.parent, env=env)
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["kind"] == "alert" and e["rule"] == "straggler"]


def test_a_rank_with_slow_data_is_the_straggler(recipe, tmp_path):
    # Logged steps 2, 4, 6, 8: slow from step 4, so the third slow interval in a row is step 8.
    alerts = _stragglers(recipe, tmp_path / "slow", "train.max_steps=8", "log.every_steps=2",
                         env={"TRAINBOOK_FAULT": "data.slow_batch@4+", "TRAINBOOK_FAULT_RANK": "1"})
    assert [a["step"] for a in alerts] == [8], alerts  # once: repeat_after_s (300 s) holds the rest back
    alert = alerts[0]
    assert re.fullmatch(r"rank 1 \(host (\S+)\) is the straggler for 3 logging intervals: the others wait "
                        r"[\d.]+ s a step for it; its time goes to data loading \(data [\d.]+ s vs median [\d.]+ s\)",
                        alert["message"]), alert["message"]
    assert f"(host {socket.gethostname()})" in alert["message"]
    assert alert["value"] > alert["threshold"] > 0
    # The data figures it quotes: rank 1's data phase is most of the wait it causes.
    data, median = map(float, re.search(r"data ([\d.]+) s vs median ([\d.]+) s", alert["message"]).groups())
    assert data > 5 * median and data > alert["value"] / 2, alert


def test_a_clean_run_has_no_straggler(recipe, tmp_path):
    # Every step logged: 24 intervals judged, none with a rank the others wait for.
    assert _stragglers(recipe, tmp_path / "clean", "train.max_steps=24", "log.every_steps=1") == []
