"""Elastic fault tolerance under torchrun's agent: real workers killed, stopped and lost.

Every failure is real: a worker SIGKILLs itself at a fault point, a worker is SIGSTOPped (the
hang watchdog must find it), a whole "node" (a second agent with its worker) is killed. The runs
use a warmup longer than the checkpoint interval, so a restart that lost the optimizer moments,
the schedule or the data position would change the loss series.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import readme
from tests.conftest import prepared_recipe, run_cli
from trainbook.checkpoint import load_state, read_latest
from trainbook.config import load_config
from trainbook.model import build_model, resolve
from trainbook.parallel.runtime import free_port

pytestmark = pytest.mark.slow

STEPS = ["train.max_steps=12", "checkpoint.interval_steps=2", "log.every_steps=1", "schedule.warmup_steps=6",
         "train.eval_every=0", "parallel.timeout_s=120", "parallel.hang_timeout_s=5"]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, debug_data) -> Path:
    return prepared_recipe(tmp_path_factory.mktemp("elastic"), debug_data)


def _run(recipe: Path, run_dir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli("run", str(recipe), *STEPS, *args, "--run-dir", str(run_dir), cwd=recipe.parent, env=env,
                   timeout=600)


@pytest.fixture(scope="module")
def straight(recipe, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run every restarted run must equal."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    done = _run(recipe, run_dir, "--nproc", "2")
    assert done.returncode == 0, done.stderr
    return run_dir


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _train(run_dir: Path) -> list[dict]:
    return [r for r in _jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in _jsonl(run_dir / "events.jsonl") if e["kind"] == kind]


def _final_weights(run_dir: Path) -> dict:
    cfg = load_config(run_dir / "config.resolved.toml")
    state = {"model": build_model(resolve(cfg.model), "cpu", seed=123).state_dict()}
    load_state(run_dir / "checkpoints" / f"step-{read_latest(run_dir / 'checkpoints')}", state)
    return state["model"]


def test_three_random_kills_restart_and_equal_the_straight_run_bitwise(recipe, straight, tmp_path):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # Attempt i dies at step s_i, after the step before it resumed from: s_0 < s_1 < s_2.
    steps = sorted(rng.sample(range(2, 12), 3))
    ranks = [rng.randrange(2) for _ in steps]
    fault = ",".join(f"train.after_step@{s}:r{r}:a{a}" for a, (s, r) in enumerate(zip(steps, ranks)))
    run_dir = tmp_path / "run"
    done = _run(recipe, run_dir, "--nproc", "2", "--max-restarts", "3", env={"TRAINBOOK_FAULT": fault})
    why = f"seed {seed}: {fault}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, why

    restarts = _events(run_dir, "restart")
    assert [e["attempt"] for e in restarts] == [1, 2, 3], why
    for event, step, rank in zip(restarts, steps, ranks):
        assert event["failed"][0]["rank"] == rank and event["failed"][0]["signal"] == "SIGKILL", (event, why)
        # Killed after step s: the checkpoint of s (even s) or of s - 1 is where it went on from.
        assert event["resumed_step"] == step - step % 2 and event["steps_lost"] == step % 2, (event, why)
    health = json.loads((run_dir / "health.json").read_text())
    assert health["state"] == "finished" and health["attempt"] == 3 and health["step"] == 12

    ours, theirs = _train(run_dir), _train(straight)
    assert [r["step"] for r in ours] == list(range(1, 13)), why  # every step once, in order
    assert [(r["loss"], r["grad_norm"], r["samples"]) for r in ours] == \
        [(r["loss"], r["grad_norm"], r["samples"]) for r in theirs], why
    a, b = _final_weights(run_dir), _final_weights(straight)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), why


def test_the_same_failure_at_the_same_step_ends_with_the_repeated_failure_verdict(recipe, tmp_path):
    run_dir = tmp_path / "run"
    done = _run(recipe, run_dir, "--nproc", "2", "--max-restarts", "2",
                env={"TRAINBOOK_FAULT": "data.next_batch@5:r1"})  # in every attempt
    assert done.returncode == 6, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("trainbook: error: ")]
    assert len(lines) == 1 and lines[0].startswith(
        "trainbook: error: step 5 failed 3 times in a row (rank 1 (killed by SIGKILL) each time): a failure that "
        "repeats; the 2 restarts of --max-restarts are spent"), done.stderr
    readme.assert_printed("every attempt, `--max-restarts 2`):", done.stderr)
    failed = _events(run_dir, "worker_failed")
    assert [(e["rank"], e["signal"], e["step"], e["then"]) for e in failed] == \
        [(1, "SIGKILL", 5, "restart"), (1, "SIGKILL", 5, "restart"), (1, "SIGKILL", 5, "give up")]
    assert [e["resumed_step"] for e in _events(run_dir, "restart")] == [4, 4]
    assert json.loads((run_dir / "health.json").read_text())["state"] == "failed"


def test_a_stopped_worker_is_found_by_the_watchdog_and_the_run_restarts(recipe, straight, tmp_path):
    run_dir = tmp_path / "run"
    env = {"TRAINBOOK_FAULT": "data.next_batch@5:r1:a0", "TRAINBOOK_FAULT_ACTION": "stop"}
    done = _run(recipe, run_dir, "--nproc", "2", "--max-restarts", "1", env=env)
    assert done.returncode == 0, done.stderr[-3000:]

    hang = _events(run_dir, "hang")
    assert len(hang) == 1 and hang[0]["stuck_ranks"] == [1] and hang[0]["step"] == 5, hang
    verdict = json.loads((run_dir / "hang" / "verdict.json").read_text())
    assert verdict["killed"] == [1]  # the stopped rank, so the agent sees the failure
    (restart,) = _events(run_dir, "restart")
    assert restart["resumed_step"] == 4 and restart["world_size"] == 2
    assert [(r["step"], r["loss"]) for r in _train(run_dir)] == [(r["step"], r["loss"]) for r in _train(straight)]


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process under it (torchrun starts its workers in sessions of
    their own: a process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_lost_node_shrinks_the_run_and_its_return_grows_it_back(recipe, tmp_path):
    """Two agents on this machine as two nodes (`--nnodes 1:2`): one is killed with its worker
    after step 5; the other goes on alone and holds after step 8 until a new node joins.

    The rendezvous store is this test's, as a cluster's rendezvous host would hold it: no agent
    hosts it, so the node that is lost takes nothing with it, and both nodes are started at the
    same moment (the first round closes 10 s, launch.LAST_CALL_S, after its first node joins: a
    node that started only once another was up could miss it on a loaded machine and start a
    run of its own)."""
    run_dir, port = tmp_path / "run", free_port()
    reached_lost, reached_alone = tmp_path / "reached-lost", tmp_path / "reached-alone"
    cmd = [sys.executable, "-m", "trainbook", "run", str(recipe), *STEPS, "--nproc", "1", "--nnodes", "1:2",
           "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "shrink", "--max-restarts", "1",
           "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "TRAINBOOK_FAULT_ACTION": "wait", "TRAINBOOK_FAULT_RELEASE": str(tmp_path / "never")}

    def agent(fault: str | None, reached: Path | None) -> subprocess.Popen:
        extra = {"TRAINBOOK_FAULT": fault, "TRAINBOOK_FAULT_REACHED": str(reached)} if fault else {}
        return subprocess.Popen(cmd, cwd=recipe.parent, env={**env, **extra}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def wait_for(path: Path, *procs: subprocess.Popen) -> None:
        while not path.exists():
            for proc in procs:
                assert proc.poll() is None, proc.stdout.read()[-4000:]
            time.sleep(0.1)

    # An agent finding the endpoint's port taken joins as the store's client (c10d's fallback).
    store = torch.distributed.TCPStore("localhost", port, is_master=True, multi_tenant=True)
    # The survivor: after the shrink (its restart count is 1 then), it holds still after step 8
    # until a SIGTERM: the one its agent sends when a new node is waiting at the rendezvous.
    survivor = agent("train.after_step@8:a1", reached_alone)
    # The lost node's worker holds still after step 5, whichever rank it is, until it is killed.
    lost = agent("train.after_step@5:a0", reached_lost)
    procs = [survivor, lost]
    try:
        wait_for(reached_lost, survivor, lost)
        _kill_tree(lost.pid)  # the node is gone: its launcher, its agent and its worker
        wait_for(reached_alone, survivor)  # alone since step 4's checkpoint, now after step 8
        back = agent(None, None)  # the node returns
        procs.append(back)
        outs = [p.communicate(timeout=600)[0] for p in (survivor, back)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_tree(proc.pid)
        del store
    assert survivor.returncode == 0 and back.returncode == 0, outs[0][-4000:]

    shrink, grow = _events(run_dir, "restart")
    assert (shrink["world_size"], shrink["previous_world_size"], shrink["resumed_step"]) == (1, 2, 4)
    # The survivor's own worker found its peer gone at its next collective: a Python error
    # (exit 1), no hang declared, no timeout waited for.
    assert [(f["exit_code"], f["step"]) for f in shrink["failed"]] == [(1, 6)] and not _events(run_dir, "hang")
    assert (grow["world_size"], grow["previous_world_size"], grow["failed"]) == (2, 1, [])
    assert grow["resumed_step"] == 9  # the SIGTERM's checkpoint, after the step it was in
    readme.assert_printed("with its worker after step 5:", readme.events((run_dir / "events.jsonl").read_text()),
                          mask=True)
    ours = _train(run_dir)
    # Every step once; the data position after step k is k global batches of 8 samples, on 2
    # ranks, on 1 and on 2 again: no sample trained twice, none skipped.
    assert [(r["step"], r["samples"]) for r in ours] == [(k, 8 * k) for k in range(1, 13)]
    # One node of the same global batch (accumulation 2 instead of 2 ranks) trains the same steps.
    alone = _run(recipe, tmp_path / "alone")
    assert alone.returncode == 0, alone.stderr
    theirs = _train(tmp_path / "alone")
    assert [r["samples"] for r in theirs] == [r["samples"] for r in ours]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(ours, theirs)) < 1e-5
