"""Hang diagnosis, proven by real hangs in real 2-rank `trainbook run --nproc 2` runs (gloo).

Rank 1 is stopped at the data-loading fault point of step 3 (trainbook/faults.py): either alive
and sleeping there (it can still speak: its watchdog thread writes its own stacks) or stopped
whole by SIGSTOP (it cannot: the other rank names it from its last record and takes its stacks
from outside). Nothing waits on a clock: the fault point marks its moment in a file, and the
bound on the exit is the contract's (hang_timeout_s + 45 s), far from what a run needs.
"""

from __future__ import annotations

import json
import os
import re
import time
import tomllib
from pathlib import Path

import pytest

from tests import readme
from tests.conftest import prepared_recipe, run_cli, run_cli_error, worker_exits

pytestmark = pytest.mark.slow

HANG_TIMEOUT_S = 4
QUICK = (f"parallel.hang_timeout_s={HANG_TIMEOUT_S}", "parallel.timeout_s=120", "train.max_steps=6",
         "train.eval_every=0")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, debug_data) -> Path:
    """The debug recipe over the session's prepared data, for every run in this module."""
    return prepared_recipe(tmp_path_factory.mktemp("hang"), debug_data)


def _hang(recipe: Path, run_dir: Path, action: str):
    """A 2-rank run whose rank 1 stops at the first batch of step 3 with `action`; the finished
    process, and the seconds from the stop to the end of every process (torchrun waits for all)."""
    reached = run_dir.parent / f"{run_dir.name}.reached"
    env = {"TRAINBOOK_FAULT": "data.next_batch@3", "TRAINBOOK_FAULT_RANK": "1", "TRAINBOOK_FAULT_ACTION": action,
           "TRAINBOOK_FAULT_REACHED": str(reached)}
    done = run_cli("run", str(recipe), *QUICK, "--run-dir", str(run_dir), "--nproc", "2", cwd=recipe.parent,
                   env=env, timeout=600)
    return done, time.time() - reached.stat().st_mtime


def _verdict_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("trainbook: error: ")]
    assert len(lines) == 1, stderr  # the lowest live rank alone speaks
    return lines[0]


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_rank_sleeping_in_data_loading_is_named_with_its_stacks(recipe, tmp_path):
    run_dir = tmp_path / "sleeps"
    done, seconds = _hang(recipe, run_dir, "hang")

    assert done.returncode == 4, done.stderr  # a diagnosed hang (errors.py)
    line = _verdict_line(done.stderr)
    assert re.search(r"rank 0 waits in \w+ #\d+ \(step 3, forward\); rank 1 \(host [^)]+\) never reached it: "
                     r"it is in data loading of step 3, stack in hang/rank1.txt$", line), line
    readme.assert_printed("A rank stuck in data loading", done.stderr, command="trainbook run", mask=True)
    assert readme.status("A rank stuck in data loading", "trainbook run") == done.returncode
    verdict = json.loads((run_dir / "hang" / "verdict.json").read_text())
    assert verdict["waiting"] == [0] and verdict["step"] == 3 and verdict["seq"] > 0
    assert [(s["rank"], s["phase"], s["speaks"]) for s in verdict["stuck"]] == [(1, "data", True)]
    assert line == f"trainbook: error: {verdict['verdict']}"
    assert (run_dir / "hang" / "verdict.txt").read_text().strip() == verdict["verdict"]
    # Its own stacks, written by its watchdog thread: the main thread is in the data path.
    stacks = (run_dir / "hang" / "rank1.txt").read_text()
    assert re.search(r"fault_hooks.py\", line \d+ in __next__\n(.*\n)*?.*step.py\", line \d+ in __call__", stacks), stacks
    assert re.search(r"line \d+ in foreach_all_gather", (run_dir / "hang" / "rank0.txt").read_text())
    hang = [e for e in _events(run_dir) if e["kind"] == "hang"]
    assert [(e["step"], e["stuck_ranks"], e["dir"], e["verdict"]) for e in hang] == \
        [(3, [1], "hang", verdict["verdict"])]
    # The run's end marker, then what the agent saw (commands/elastic.py): rank 0 gave up, exit 4.
    end, failed = _events(run_dir)[-2:]
    assert (end["kind"], end["status"]) == ("end", "failed")
    assert (failed["kind"], failed["exit_code"], failed["then"]) == ("worker_failed", 4, "give up")
    # Every process gone, each with a non-zero code, within the contract's bound of the stall.
    assert worker_exits(done.stderr) == {0: 4, 1: 4}, done.stderr
    assert seconds < HANG_TIMEOUT_S + 45, seconds

    # `trainbook doctor` on the directory this real hang left: the verdict, who waits, the stacks.
    doctor = run_cli("doctor", str(run_dir))
    assert doctor.returncode == 1 and "Traceback" not in doctor.stderr, doctor.stderr
    out = doctor.stdout
    assert out.splitlines()[0] == f"hang: {verdict['verdict']}", out
    assert f"hang/verdict.json: step 3, collective {verdict['collective']} #{verdict['seq']}, waiting: ranks [0]" in out
    assert re.search(r"stuck: rank 1 on \S+ in step 3, phase data \(stacks: hang/rank1.txt\)", out), out
    assert "next: read the stuck rank's stacks (hang/rank1.txt) and its log" in out


def test_stopped_rank_is_named_from_its_last_record_and_killed(recipe, tmp_path):
    run_dir = tmp_path / "stopped"
    done, seconds = _hang(recipe, run_dir, "stop")

    assert done.returncode == 4, done.stderr
    line = _verdict_line(done.stderr)
    assert re.search(r"rank 0 waits in \w+ #\d+ \(step 3, forward\); rank 1 \(host [^)]+, pid \d+\) cannot speak "
                     r"\(stopped, in a kernel, or in a C call that holds the GIL\) and had not reached it when "
                     r"last heard from \(.+ of step \d\); stack taken from outside in hang/rank1.txt$", line), line
    # Where it was last heard from depends on when its last record went out: read as the README's.
    heard = re.search(r"when last heard from \((.+?)\);", line)[1]
    readme.assert_printed("The same rank stopped whole", done.stderr, mask=True,
                          replace={f"last heard from ({heard})": "last heard from (optimizer of step 1)"})
    verdict = json.loads((run_dir / "hang" / "verdict.json").read_text())
    assert verdict["silent"] == [1] and [s["speaks"] for s in verdict["stuck"]] == [False]
    assert verdict["killed"] == [1]
    # Taken by py-spy from outside the stopped process: its main thread sits at the fault point.
    stacks = (run_dir / "hang" / "rank1.txt").read_text()
    assert "py-spy" in stacks and re.search(r"fault_point .*\n\s+FaultyBatches.__next__ ", stacks), stacks
    # The stopped rank was killed (SIGKILL: -9), the live one exited 4, all within the bound.
    assert worker_exits(done.stderr) == {0: 4, 1: -9}, done.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(verdict["stuck"][0]["pid"], 0)
    assert seconds < HANG_TIMEOUT_S + 45, seconds


def test_hang_timeout_not_below_the_collective_timeout_is_bad_input(recipe, tmp_path):
    line = run_cli_error("run", str(recipe), "parallel.timeout_s=10", "parallel.hang_timeout_s=10",
                         "--run-dir", str(tmp_path / "r"), "--nproc", "2", cwd=tmp_path)
    assert "parallel.hang_timeout_s" in line and "must be below parallel.timeout_s (10 s)" in line, line


def test_clean_run_writes_no_hang(clean_pair):
    # The session's clean 2-rank run (tests/conftest.py): the watchdog on at 10 s, with a timeout no
    # step of this tiny model comes near even on a loaded machine, over a run that lasts longer
    # than it (400 steps, an eval and a checkpoint): judged by progress, not by time.
    assert clean_pair.done.returncode == 0, clean_pair.done.stderr
    resolved = tomllib.loads((clean_pair.run_dir / "config.resolved.toml").read_text())
    assert resolved["parallel"]["hang_timeout_s"] == 10  # the watchdog was on
    assert not (clean_pair.run_dir / "hang").exists()
    assert not [e for e in _events(clean_pair.run_dir) if e["kind"] == "hang"]
