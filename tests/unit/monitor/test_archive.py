"""Run directories read back, and the status each one's files support (monitor/archive.py)."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainbook.errors import TrainbookError
from trainbook.config import dotted_keys
from trainbook.monitor.archive import find_runs, load_run

HOST = socket.gethostname()


def make_run(path: Path, *, events=(), train_steps=(2, 4), max_steps=4, checkpoints=(), metrics=True,
             lr=1e-3, tokens_per_step=256) -> Path:
    """A run directory written the way the trainer writes one (only what the readers look at)."""
    path.mkdir(parents=True)
    (path / "config.resolved.toml").write_text(
        f'[run]\nname = "unit"\n\n[train]\nmax_steps = {max_steps}\n\n[optim]\nlr = {lr}\n')
    if metrics:
        lines = [{"kind": "train", "step": s, "tokens": s * tokens_per_step, "loss": 6.0 - s * lr * 100,
                  "tokens_per_s": 1000.0 + s, "lr": lr, "grad_norm": 1.0, "mem_peak_bytes": 1 << 20}
                 for s in train_steps]
        lines += [{"kind": "eval", "step": s, "val_loss": 6.5 - s * lr * 100} for s in train_steps]
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (path / "events.jsonl").write_text("".join(json.dumps({"time": 1.0e9 + i, **e}) + "\n" for i, e in enumerate(events)))
    for step in checkpoints:
        (path / "checkpoints" / f"step-{step}").mkdir(parents=True)
    return path


def start(pid: int, host: str = HOST) -> dict:
    return {"kind": "start", "step": 0, "pid": pid, "host": host, "tokens_per_step": 256}


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


@pytest.mark.parametrize("status", ["finished", "stopped", "failed"])
def test_the_end_marker_decides(tmp_path, status):
    end = {"kind": "end", "step": 4, "status": status, **({"error": "RuntimeError: boom"} if status == "failed" else {})}
    run = load_run(make_run(tmp_path / "r", events=[start(dead_pid()), end]))
    assert run.status == status
    assert (run.status_detail == "RuntimeError: boom") if status == "failed" else "step 4" in run.status_detail


def test_a_live_trainbook_process_is_running_and_a_dead_one_died(tmp_path):
    # The process's command line must name trainbook: a pid reused by another program is not the run.
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "trainbook"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert load_run(make_run(tmp_path / "live", events=[start(live.pid)])).status == "running"
        assert load_run(make_run(tmp_path / "reused", events=[start(other.pid)])).status == "died"
    finally:
        for p in (live, other):
            p.kill()
            p.wait()
    assert load_run(make_run(tmp_path / "dead", events=[start(dead_pid())])).status == "died"


def test_only_the_last_attempt_counts(tmp_path):
    events = [start(dead_pid()), {"kind": "end", "step": 2, "status": "stopped"},
              {"kind": "resume", "step": 2, "pid": dead_pid(), "host": HOST}]
    assert load_run(make_run(tmp_path / "r", events=events)).status == "died"  # the resumed attempt left no end


def test_another_host_or_no_process_facts_is_unknown(tmp_path):
    assert load_run(make_run(tmp_path / "a", events=[start(1, host="elsewhere")])).status == "unknown"
    # Written before end markers: what the run left decides, else nothing can be known.
    assert load_run(make_run(tmp_path / "b", events=[{"kind": "start", "step": 0}])).status == "unknown"
    assert load_run(make_run(tmp_path / "c", events=[{"kind": "start", "step": 0}], checkpoints=[4])).status == "finished"
    stopped = [{"kind": "start", "step": 0}, {"kind": "stopped", "step": 2, "signal": "SIGTERM"}]
    assert load_run(make_run(tmp_path / "d", events=stopped)).status == "stopped"


def test_summary_facts_and_lenient_lines(tmp_path):
    path = make_run(tmp_path / "r", events=[start(dead_pid()), {"kind": "end", "step": 4, "status": "finished"}])
    with open(path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 6, "lo')  # a line cut short by a crash
    run = load_run(path)
    assert [r["step"] for r in run.train] == [2, 4] and run.steps == 4
    assert run.final_loss == pytest.approx(5.6) and run.final_val_loss == pytest.approx(6.1)
    assert run.tokens_per_s == pytest.approx(1003.0) and run.tokens_per_step == 256
    assert run.layers == [] and run.name == "unit" and run.started == 1.0e9
    assert dotted_keys(run.config) == {"run.name": "unit", "train.max_steps": 4, "optim.lr": 1e-3}


def test_not_a_run_directory(tmp_path):
    with pytest.raises(TrainbookError, match="no such run directory"):
        load_run(tmp_path / "nowhere")
    with pytest.raises(TrainbookError, match="not a run directory"):
        load_run(tmp_path)
    bare = make_run(tmp_path / "bare", metrics=False)
    with pytest.raises(TrainbookError, match="metrics.jsonl"):
        load_run(bare)
    assert load_run(bare, need_metrics=False).train == []


def test_find_runs_does_not_descend_into_a_run(tmp_path):
    a = make_run(tmp_path / "x" / "a")
    b = make_run(tmp_path / "y" / "b")
    make_run(a / "nested")  # inside a run: not a run of the archive
    assert find_runs(tmp_path) == [a, b]
