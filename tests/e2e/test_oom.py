"""Out of memory and leaks, each caused for real in a real `trainbook run` (trainbook/faults.py):

- `model.block_oom@N`: block TRAINBOOK_FAULT_BLOCK asks the allocator for a PiB in step N's
  forward; the CPU allocator's own failure is caught, the breakdown written, the run ends with
  exit 3 and one line;
- the same on rank 1 of two FSDP ranks: rank 1 writes the breakdown and ends, rank 0 fails on its
  collective with it, and the run ends with rank 1's verdict (a safety timeout, no sleeps);
- `train.leak` (kept in the data phase) against `model.block_leak` (kept in the forward phase):
  the memory_growth alert names the phase that grows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import prepared_recipe, run_cli
from trainbook.sizes import human

BREAKDOWN_KEYS = {"step", "rank", "phase", "block", "device", "error", "requested_bytes", "measured", "plan",
                  "alternatives", "considered", "snapshot", "verdict"}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return prepared_recipe(tmp_path_factory.mktemp("oom"))


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _verdict_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("trainbook: error: ")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_an_allocation_that_fails_in_a_block_is_diagnosed(recipe, tmp_path):
    run_dir = tmp_path / "oom"
    done = run_cli("run", str(recipe), "train.eval_every=0", "--run-dir", str(run_dir), cwd=recipe.parent,
                   env={"TRAINBOOK_FAULT": "model.block_oom@3", "TRAINBOOK_FAULT_BLOCK": "1"})
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [_verdict_line(done.stderr)]
    line = _verdict_line(done.stderr)
    assert line.startswith("trainbook: error: out of memory in step 3 (forward, block 1): could not allocate "
                           "1024 TiB with "), line
    assert f"see {run_dir / 'oom' / 'breakdown.json'}" in line

    breakdown = json.loads((run_dir / "oom" / "breakdown.json").read_text())
    assert set(breakdown) >= BREAKDOWN_KEYS
    assert (breakdown["step"], breakdown["phase"], breakdown["block"]) == (3, "forward", "block 1")
    assert breakdown["requested_bytes"] == 1 << 50
    assert "DefaultCPUAllocator: can't allocate memory" in breakdown["error"]
    m, plan = breakdown["measured"], breakdown["plan"]
    # The weights and AdamW's states as plan counts them (exact bytes); gradients were dropped
    # after step 2's update, and step 3 failed before its backward.
    assert m["parameters"] == plan["params"] and m["optimizer"] == plan["optimizer"] and m["gradients"] == 0
    assert m["rss"] > 0 and m["peak"] >= m["rss"]
    assert set(breakdown["estimated"]["activations_by_block"]) == {"block 0", "block 1"}
    # Alternatives: exact overrides that plan says fit, each holding less than the recipe as it ran.
    alternatives = breakdown["alternatives"]
    assert ["train.activation_checkpoint=selective"] in [a["overrides"] for a in alternatives]
    assert all(a["estimate_bytes"] < plan["total"] <= plan["device_memory"] for a in alternatives)
    # A PiB is no layout's problem: the line says so instead of suggesting one.
    assert line.endswith("no layout makes it fit"), line
    assert breakdown["verdict"] == line.removeprefix("trainbook: error: ")

    oom = [e for e in _events(run_dir) if e["kind"] == "oom"]
    assert len(oom) == 1 and oom[0]["breakdown"] == "oom/breakdown.json" and oom[0]["verdict"] == breakdown["verdict"]
    end = _events(run_dir)[-1]
    assert end["kind"] == "end" and end["status"] == "failed" and end["error"].startswith("DiagnosedFailure: out of memory")

    # `trainbook doctor` on the directory this real failure left: the oom verdict, the run's own numbers.
    doctor = run_cli("doctor", str(run_dir))
    assert doctor.returncode == 1 and "Traceback" not in doctor.stderr, doctor.stderr
    out = doctor.stdout
    assert out.splitlines()[0] == f"oom: {breakdown['verdict']}", out
    assert "events.jsonl: out of memory in step 3, phase forward" in out
    assert f"oom/breakdown.json measured on cpu: parameters {human(m['parameters'])}, " in out, out
    assert "fits by the plan's estimate (" in out and "next: rerun with train.activation_checkpoint=selective" in out
    assert "playbook: README.md > Playbooks > Out of memory" in out


def test_one_rank_out_of_memory_ends_the_whole_run(recipe, tmp_path):
    run_dir = tmp_path / "oom2"
    # The safety net only: the run ends on its own once rank 1 has written its breakdown.
    done = run_cli("run", str(recipe), "train.eval_every=0", "diagnose.memory_history=true", "--nproc", "2",
                   "--run-dir", str(run_dir), cwd=recipe.parent, timeout=300,
                   env={"TRAINBOOK_FAULT": "model.block_oom@3", "TRAINBOOK_FAULT_BLOCK": "1",
                        "TRAINBOOK_FAULT_RANK": "1"})
    assert done.returncode == 3, done.stderr
    line = _verdict_line(done.stderr)
    assert line.startswith("trainbook: error: out of memory in step 3 (forward, block 1) on rank 1: "), line

    breakdown = json.loads((run_dir / "oom" / "breakdown.json").read_text())
    assert breakdown["rank"] == 1 and breakdown == json.loads((run_dir / "oom" / "rank1.json").read_text())
    assert not (run_dir / "oom" / "rank0.json").exists()
    m, plan = breakdown["measured"], breakdown["plan"]
    # FSDP over 2 ranks: this rank's shards, as plan places them, and the gathered full copies of
    # the blocks in flight apart.
    assert m["parameters"] == plan["params"] and m["optimizer"] == plan["optimizer"]
    assert m["fsdp_gathered"] > 0
    # memory_history: what each block saved for backward in the failing micro-batch, measured.
    measured = m["activations_by_block"]
    assert set(measured) == {"block 0", "block 1"} and all(v > 0 for v in measured.values()), measured
    assert "estimated" not in breakdown

    events = _events(run_dir)
    assert [e["rank"] for e in events if e["kind"] == "oom"] == [1]
    end = [e for e in events if e["kind"] == "end"][-1]
    assert end["error"].startswith("DiagnosedFailure: out of memory") and events[-1]["kind"] == "worker_failed"
    # Rank 0 (pid in the start event) is gone: no worker outlives the command.
    pid = next(e["pid"] for e in events if e["kind"] == "start")
    assert not os.path.exists(f"/proc/{pid}")


@pytest.mark.parametrize(("fault", "phase"), [("train.leak", "data"), ("model.block_leak", "forward")])
def test_a_leak_alert_names_the_phase_that_grows(recipe, tmp_path, fault, phase):
    run_dir = tmp_path / fault
    # 16 MiB kept per step against the default limit of 1 MiB per step.
    done = run_cli("run", str(recipe), "train.max_steps=14", "train.eval_every=0", "alerts.window=5",
                   "--run-dir", str(run_dir), cwd=recipe.parent, env={"TRAINBOOK_FAULT": fault})
    assert done.returncode == 0, done.stderr
    growth = [e for e in _events(run_dir) if e["kind"] == "alert" and e["rule"] == "memory_growth"]
    assert growth, _events(run_dir)
    assert f"; it grows in phase {phase} (" in growth[0]["message"], growth[0]["message"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    late = [r["mem_growth_by_phase"] for r in records if r["kind"] == "train" and r["step"] >= 6]
    assert all(r[phase] >= 15 << 20 for r in late), late
