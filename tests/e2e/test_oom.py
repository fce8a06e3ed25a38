"""Out of memory and leaks, each caused for real in a real `trainbook run` (trainbook/faults.py):

- `model.block_oom@N`: block TRAINBOOK_FAULT_BLOCK asks the allocator for a PiB in step N's
  forward; the CPU allocator's own failure is caught, the breakdown written, the run ends with
  exit 3 and one line;
- the same on rank 1 of two FSDP ranks: rank 1 writes the breakdown and ends, rank 0 fails on its
  collective with it, and the run ends with rank 1's verdict (a safety timeout, no sleeps);
- `train.leak` (kept in the data phase) against `model.block_leak` (kept in the forward phase):
  the memory_growth alert names the phase that grows;
- an address-space limit (RLIMIT_AS) set on a paused run, below what its steps map: the CPU
  allocator itself fails mid-step, as a user meets it under `ulimit -v`; the advice of the verdict,
  run under the same limit, trains to the end.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests import readme
from tests.conftest import PLAY, prepared_recipe, run_cli, write_recipe
from trainbook.sizes import human

pytestmark = pytest.mark.slow

BREAKDOWN_KEYS = {"step", "rank", "phase", "block", "device", "error", "requested_bytes", "measured", "plan",
                  "alternatives", "considered", "snapshot", "verdict"}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, debug_data) -> Path:
    return prepared_recipe(tmp_path_factory.mktemp("oom"), debug_data)


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
    marker = "Provoked here by a block asking the allocator for a PiB"
    readme.assert_printed(marker, done.stderr, command="trainbook run", mask=True, replace={str(run_dir): "runs/unit/oom-demo"})
    assert readme.status(marker, "trainbook run") == done.returncode

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
    readme.assert_printed("The breakdown, measured against plan", readme.fields(breakdown), mask=True)

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
    if fault == "model.block_leak":
        readme.assert_printed("16 MiB kept per step by a block's forward", growth[0]["message"], mask=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    late = [r["mem_growth_by_phase"] for r in records if r["kind"] == "train" and r["step"] >= 6]
    assert all(r[phase] >= 15 << 20 for r in late), late


# A micro-batch whose step maps a few hundred MiB, for the allocator to fail under a limit; the
# corpus just large enough to feed it 4 steps (64 Ki tokens each, 2 micro-batches of 256 x 128).
CORPUS_LINES = 10_000  # a line is ~6 tokens: 6 x 10,000 lines feed 4 steps of 64 Ki tokens
BIG_STEP = ("train.micro_batch_size=256", "train.seq_len=128", "train.global_batch_tokens=65536",
            "train.max_steps=4", "train.eval_every=0", "log.every_steps=1")


def _status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


def _paused(cmd: list[str], cwd: Path, tmp: Path, step: int) -> tuple[subprocess.Popen, Path]:
    """`cmd` started and held at the first batch of `step`, and the file that lets it go on. The
    pause is met through a FIFO the fault point opens to say it is there: no polling, no sleep."""
    reached, release = tmp / f"reached{step}", tmp / f"release{step}"
    os.mkfifo(reached)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRAINBOOK_FAULT": f"data.next_batch@{step}",
           "TRAINBOOK_FAULT_ACTION": "wait", "TRAINBOOK_FAULT_REACHED": str(reached),
           "TRAINBOOK_FAULT_RELEASE": str(release)}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    threading.Thread(target=_unblock_on_exit, args=(proc, reached), daemon=True).start()
    with open(reached):  # returns once the run is at the fault point (or has ended)
        pass
    if proc.poll() is not None:
        pytest.fail(f"the run ended before step {step}: {proc.communicate()}")
    return proc, release


def _limited_at_step_2(cmd: list[str], run_dir: Path, tmp: Path) -> tuple[subprocess.CompletedProcess, int]:
    """`cmd` (in `run_dir`) given an address-space limit at the first batch of step 2: what the
    recipe maps before its first step (VmSize, read from the same command held at step 1), plus
    half of what its first step mapped beyond that (VmPeak at step 2), for the CPU allocator to
    fail in a step from there on. The finished process and the limit."""
    before, _ = _paused([*cmd, "--run-dir", str(run_dir.with_name(f"{run_dir.name}-footprint"))], tmp, tmp, 1)
    footprint = _status_bytes(before.pid, "VmSize")
    before.kill()
    before.communicate()
    proc, release = _paused([*cmd, "--run-dir", str(run_dir)], tmp, tmp, 2)
    try:
        limit = footprint + (_status_bytes(proc.pid, "VmPeak") - footprint) // 2
        try:
            resource.prlimit(proc.pid, resource.RLIMIT_AS, (limit, limit))
        except (OSError, ValueError) as e:
            pytest.skip(f"this OS refuses an address-space limit (prlimit RLIMIT_AS) on a child: {e}")
    finally:
        release.touch()
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), limit


def _unblock_on_exit(proc: subprocess.Popen, fifo: Path) -> None:
    """A run that ends before its fault point would leave the reader of `fifo` waiting: open it
    for writing once the run has ended (nobody reads it any more if the pause came first)."""
    proc.wait()
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader: it had already met the pause
        pass


def test_a_real_allocation_failure_under_an_address_space_limit_gives_advice_that_trains(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = PLAY.splitlines()
    for i in range(6):
        text = "\n".join(lines[(j * (i + 1)) % len(lines)] for j in range(CORPUS_LINES))
        (corpus / f"scene{i}.txt").write_text(text)
    recipe = write_recipe(tmp_path / "unit.toml", corpus)
    assert run_cli("prepare", str(recipe)).returncode == 0
    trainbook = [sys.executable, "-m", "trainbook", "run", str(recipe), *BIG_STEP]

    run_dir = tmp_path / "limited"
    done, limit = _limited_at_step_2(trainbook, run_dir, tmp_path)
    assert done.returncode == 3, (limit, done.stderr)  # out of memory, diagnosed (errors.py)
    assert "Traceback" not in done.stderr, done.stderr
    line = _verdict_line(done.stderr)
    assert done.stderr.strip().splitlines() == [line], done.stderr
    # From step 2 on: the allocator may still serve a step from what it kept of the one before.
    assert re.match(r"trainbook: error: out of memory in step [234] \((forward|backward)[^)]*\): could not allocate ",
                    line), line
    breakdown = json.loads((run_dir / "oom" / "breakdown.json").read_text())
    assert breakdown["verdict"] == line.removeprefix("trainbook: error: ")
    assert "DefaultCPUAllocator: can't allocate memory" in breakdown["error"], breakdown["error"]
    advice = re.search(r"; try (.+?)(?: with --nproc (\d+))? \(plan: [^)]+/rank\)$", line)
    assert advice, line
    overrides = advice.group(1).split()
    assert overrides == breakdown["alternatives"][0]["overrides"], (overrides, breakdown["alternatives"])
    nproc = ["--nproc", advice.group(2)] if advice.group(2) else []

    # Exactly the advice, under the same limit from its first instruction: it trains to the end.
    rerun = subprocess.run([*trainbook, *overrides, *nproc, "--run-dir", str(tmp_path / "advised")],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert rerun.returncode == 0, (limit, overrides, rerun.stderr)
    assert rerun.stdout.strip().splitlines()[-1].startswith("done: 4 steps, loss ")
    # The capacity judged against is the limit, less what the process maps besides its states.
    space = breakdown["plan"]["address_space"]
    assert space["limit"] == limit and breakdown["plan"]["device_memory"] == space["capacity"] < limit
