"""The pieces of elastic restarts that a real run reaches only in rare cases: per-attempt fault
qualifiers, the verdict when failures differ, restart events without a failure, health states."""

from __future__ import annotations

import json

from trainbook.commands.launch import repeated_failure
from trainbook.errors import HangFailure
from trainbook.faults import fault_active
from trainbook.monitor.health import HealthFile, read_health
from trainbook.commands.elastic import restart_event, restart_line, signal_name
from trainbook.phase import Phase


def test_fault_qualifiers_pick_the_rank_and_the_attempt(monkeypatch):
    monkeypatch.setenv("TRAINBOOK_FAULT", "train.after_step@7:r1:a0,train.after_step@13:r0:a1,train.after_step@20")
    cases = {("1", "0"): [7, 20], ("0", "0"): [20], ("0", "1"): [13, 20], ("1", "1"): [20]}
    for (rank, attempt), steps in cases.items():
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        assert [s for s in range(30) if fault_active("train.after_step", s)] == steps, (rank, attempt)


def test_failures_at_different_steps_are_listed_in_the_verdict():
    failed = [{"step": 6, "rank": 1, "signal": "SIGKILL", "exit_code": -9},
              {"step": 14, "rank": 0, "signal": None, "exit_code": 1}]
    line = repeated_failure(failed, 1, HangFailure("rank 0 waits in all_reduce #3"))
    assert line.startswith("the run failed 2 times (step 6: rank 1 (killed by SIGKILL); step 14: rank 0 "
                           "(exit code 1)); the 1 restarts of --max-restarts are spent; the last: rank 0 waits")


def test_a_restart_event_reads_the_previous_attempts_failures(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    events = [{"kind": "start", "step": 0, "world_size": 2, "time": 1.0},
              {"kind": "resume", "step": 4, "world_size": 2, "time": 2.0},
              {"kind": "worker_failed", "step": 8, "time": 3.0, "rank": 1, "host": "h", "exit_code": -9,
               "signal": "SIGKILL", "last_step_done": 7}]
    event = restart_event(events, resumed_step=6, world_size=1)
    assert event["attempt"] == 2 and event["failed_step"] == 8 and event["steps_lost"] == 1
    assert event["previous_world_size"] == 2 and event["world_size"] == 1
    assert restart_line(event) == ("restart 2: rank 1 (SIGKILL) failed in step 8; resumed from step 6 "
                                   "(1 step lost) on 1 ranks (was 2)")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert restart_event(events[:2], resumed_step=4, world_size=2) is None  # a plain resume


def test_health_states_keep_where_the_run_is(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    health = HealthFile(tmp_path / "health.json")
    health.set_state("starting")
    assert read_health(tmp_path / "health.json")["state"] == "starting"
    health.on_phase(Phase.DATA, 5, "")
    health.on_phase(Phase.CHECKPOINT, 5, "")
    record = json.loads((tmp_path / "health.json").read_text())
    assert (record["state"], record["step"], record["phase"], record["attempt"]) == ("checkpointing", 5, "checkpoint", 3)
    health.set_state("failed")
    assert read_health(tmp_path / "health.json")["step"] == 5 and read_health(tmp_path / "health.json")["state"] == "failed"
    assert not list(tmp_path.glob(".health.json.tmp-*"))  # written by rename


def test_signal_names():
    assert signal_name(-9) == "SIGKILL" and signal_name(-15) == "SIGTERM" and signal_name(1) is None
