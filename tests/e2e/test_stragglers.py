"""The straggler alert, proven in real 2-rank runs (`trainbook run --nproc 2`, gloo).

Rank 1's data is slowed by the `data.slow_batch` fault point (trainbook/faults.py): from a step
on, its first batch arrives 9 times the median of its clean steps late, so the slowdown is large
against the step on any machine, and the test asserts no times. The slow-data and clean runs
are the session's (tests/conftest.py): doctor's straggler verdict and the hang watchdog's clean
case read the same runs.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from tests import readme
from tests.conftest import CLEAN_PAIR, SLOW_DATA_FAULT, SLOW_DATA_PAIR, run_cli
from trainbook.config.monitor import ALERT_RULES

pytestmark = pytest.mark.slow


def _alerts(run_dir: Path) -> list[dict]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["kind"] == "alert" and e["rule"] == "straggler"]


def test_a_rank_with_slow_data_is_the_straggler(slow_data_pair):
    # Every step logged, probed on every 2nd (2, 4, 6, 8): slow from step 4, so the third slow
    # probed interval in a row is step 8 (probing every logged step, it would be step 6).
    assert slow_data_pair.done.returncode == 0, slow_data_pair.done.stderr
    alerts = _alerts(slow_data_pair.run_dir)
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
    # The README's transcript under Monitoring is this run: its command, and the alert it printed.
    marker = "in which it spends the most more than the others' median"
    command, _ = readme.transcript(readme.block_after(marker))[0]
    assert command.split("  # ")[0].split() == [*(f"{k}={v}" for k, v in SLOW_DATA_FAULT.items()), "trainbook",
                                                "run", "unit.toml", *SLOW_DATA_PAIR], command
    readme.assert_printed(marker, slow_data_pair.done.stdout + slow_data_pair.done.stderr, mask=True,
                          command="TRAINBOOK_FAULT=data.slow_batch@4+")


def test_a_clean_run_has_no_straggler(clean_pair):
    # 100 probed intervals judged, none with a rank the others wait for.
    assert clean_pair.done.returncode == 0, clean_pair.done.stderr
    assert _alerts(clean_pair.run_dir) == []


def test_the_probes_change_no_number(clean_pair, tmp_path):
    """The same run with the straggler rule off (no probe at all), its first 8 steps: every loss
    and gradient norm bitwise equal to the probed run's."""
    off_rules = "alerts.rules=[" + ", ".join(f'"{r}"' for r in ALERT_RULES if r != "straggler") + "]"
    off_dir = tmp_path / "off"
    done = run_cli("run", str(clean_pair.recipe), *CLEAN_PAIR, "train.stop_at_step=8", off_rules,
                   "--run-dir", str(off_dir), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert _alerts(off_dir) == []
    off = _train_records(off_dir)
    on = _train_records(clean_pair.run_dir)[:8]
    assert [r["step"] for r in off] == list(range(1, 9))
    assert [(r["loss"], r["grad_norm"]) for r in off] == [(r["loss"], r["grad_norm"]) for r in on]


def _train_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"]
