"""Crashes, signals and resumes of the real `trainbook run` in subprocesses.

The runs use gradient accumulation (2 micro-batches per step) and a warmup longer than the first
checkpoint interval, so a resume that lost the optimizer moments, the schedule position, the data
position or the accumulation state would change the loss series.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import prepared_recipe, run_cli
from trainbook.checkpoint import load_state, read_latest
from trainbook.config import load_config
from trainbook.model import build_model, resolve

STEPS = ["train.max_steps=8", "checkpoint.interval_steps=2", "log.every_steps=1",
         "schedule.warmup_steps=6", "train.eval_every=3"]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _series(run_dir: Path) -> list[tuple]:
    """Every metrics line's step, kind and losses (train and eval), in file order."""
    return [(r["step"], r["kind"], r.get("loss"), r.get("val_loss")) for r in _jsonl(run_dir / "metrics.jsonl")]


def _run(recipe: Path, run_dir: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {"TRAINBOOK_FAULT": fault} if fault else {}
    return run_cli("run", str(recipe), *STEPS, *extra, "--run-dir", str(run_dir), cwd=recipe.parent, env=env)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, debug_data):
    """The recipe and one uninterrupted run of it: the series every resumed run must equal."""
    tmp = tmp_path_factory.mktemp("resume")
    recipe = prepared_recipe(tmp, debug_data)
    straight = tmp / "straight"
    done = _run(recipe, straight)
    assert done.returncode == 0, done.stderr
    series = _series(straight)
    assert [s for s, kind, *_ in series if kind == "train"] == list(range(1, 9))
    return recipe, straight, series


def _final_weights(run_dir: Path) -> dict:
    cfg = load_config(run_dir / "config.resolved.toml")
    model = build_model(resolve(cfg.model), "cpu", seed=123)
    state = {"model": model.state_dict()}
    load_state(run_dir / "checkpoints" / f"step-{read_latest(run_dir / 'checkpoints')}", state)
    return state["model"]


# (checkpoint mode, fault point, the checkpoint the run resumes from). Each kill is a fault point,
# not a signal sent from outside, so what was committed when the process died never depends on timing.
KILLS = {
    "sync-after-step": ("sync", "train.after_step@5", 4),  # step 4 was committed inside save()
    # Async, the instant step 4's commit is done: training has run on to step 4, 5 or 6 (the
    # step-6 save waits for this one), so the lines to drop are counted, not assumed.
    "async-committed": ("async", "checkpoint.after_commit@4", 4),
    # Async, a shard of step 4 on disk and no manifest: the kill hits the write in progress on
    # DCP's writer thread while training goes on, and the run goes back to step 2.
    "async-mid-write": ("async", "checkpoint.writing@4", 2),
}


def _kept(line: str, step: int) -> bool:
    try:
        return json.loads(line)["step"] <= step
    except ValueError:  # a line cut short by the kill
        return False


@pytest.mark.parametrize(("mode", "fault", "resumed_from"), KILLS.values(), ids=KILLS.keys())
def test_sigkill_then_resume_is_bitwise_identical(setup, tmp_path, mode, fault, resumed_from):
    recipe, straight, series = setup
    run_dir = tmp_path / "run"
    killed = _run(recipe, run_dir, f"checkpoint.mode={mode}", fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    ckpts = run_dir / "checkpoints"
    assert read_latest(ckpts) == resumed_from
    if fault.startswith("checkpoint.writing"):  # killed inside the save: written shards, nothing committed
        partial = ckpts / "step-4.tmp"
        assert any(p.stat().st_size > 0 for p in partial.glob("*.distcp"))
        assert not (partial / ".metadata").exists() and not (partial / "manifest.json").exists()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    dropped = sum(not _kept(line, resumed_from) for line in lines)
    if mode == "sync":
        assert max(r["step"] for r in map(json.loads, lines)) == 5 and dropped == 1

    # Continuing a run needs only its directory: the recipe comes from config.resolved.toml.
    resumed = run_cli("run", "--run-dir", str(run_dir), cwd=recipe.parent)
    assert resumed.returncode == 0, resumed.stderr
    assert f"step-{resumed_from} at step {resumed_from}" in resumed.stdout
    assert _series(run_dir) == series  # no step duplicated or missing, every loss bitwise equal
    resume = [e for e in _jsonl(run_dir / "events.jsonl") if e["kind"] == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == resumed_from
    assert resume[0]["dropped_metric_lines"] == dropped
    ours, theirs = _final_weights(run_dir), _final_weights(straight)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-4", "step-6", "step-8"]


@pytest.mark.parametrize("point", ["before_manifest", "before_rename", "before_latest"])
def test_a_kill_while_saving_resumes_from_the_previous_checkpoint(setup, tmp_path, point):
    recipe, _, series = setup
    run_dir = tmp_path / "run"
    killed = _run(recipe, run_dir, fault=f"checkpoint.{point}@4")
    assert killed.returncode == -signal.SIGKILL
    assert read_latest(run_dir / "checkpoints") == 2

    resumed = run_cli("run", "--run-dir", str(run_dir), cwd=recipe.parent)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step-2 at step 2" in resumed.stdout
    assert _series(run_dir) == series
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["latest", "step-4", "step-6", "step-8"]  # leftovers gone, keep_last = 3


def test_corrupted_checkpoints_are_skipped_with_a_warning(setup, tmp_path):
    recipe, _, series = setup
    run_dir = tmp_path / "run"
    assert _run(recipe, run_dir, "checkpoint.keep_last=4", fault="train.after_step@7").returncode == -signal.SIGKILL
    ckpts = run_dir / "checkpoints"
    shard = next((ckpts / "step-6").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    shard = next((ckpts / "step-4").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(data))

    resumed = run_cli("run", "--run-dir", str(run_dir), cwd=recipe.parent)
    assert resumed.returncode == 0, resumed.stderr
    assert _series(run_dir) == series
    events = _jsonl(run_dir / "events.jsonl")
    invalid = [(Path(e["path"]).name, e["reason"]) for e in events if e["kind"] == "checkpoint_invalid"]
    assert [name for name, _ in invalid] == ["step-6", "step-4"]
    assert "manifest says" in invalid[0][1] and "fails its checksum" in invalid[1][1]
    assert [e["step"] for e in events if e["kind"] == "resume"] == [2]
    log = next((run_dir / "logs").glob("rank0-*.log")).read_text()
    assert "WARNING" in log and "skipped invalid checkpoint" in log


def test_sigterm_saves_a_checkpoint_and_exits(setup, tmp_path):
    recipe, _, _ = setup
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Eager: left to auto, a CPU peak probe slowed by a busy machine can make 100000 steps look worth
    # compiling, and this test then spends a minute compiling (125 s in a loaded suite, 11 s alone).
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainbook", "run", str(recipe), "train.max_steps=100000", "log.every_steps=1",
         "train.eval_every=0", "train.compile=false", "--run-dir", str(run_dir)],
        cwd=recipe.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "stopped by SIGTERM at step" in out
    step = read_latest(run_dir / "checkpoints")
    assert step is not None and step >= 3
    assert f"stopped by SIGTERM at step {step}, loss" in out
    assert [e["step"] for e in _jsonl(run_dir / "events.jsonl") if e["kind"] == "stopped"] == [step]

    resumed = run_cli("run", "--run-dir", str(run_dir), f"train.max_steps={step + 2}", cwd=recipe.parent)
    assert resumed.returncode == 0, resumed.stderr
    assert f"done: {step + 2} steps" in resumed.stdout
    assert [r["step"] for r in _jsonl(metrics)] == list(range(1, step + 3))
    changed = [e["changed"] for e in _jsonl(run_dir / "events.jsonl") if e["kind"] == "resume"][0]
    assert changed == {"train.max_steps": [100000, step + 2]}


def test_resume_errors_are_one_line_and_write_nothing(setup, tmp_path):
    recipe, straight, _ = setup
    metrics_before = (straight / "metrics.jsonl").read_bytes()

    def error_of(*args: str) -> str:
        done = run_cli("run", *args, cwd=recipe.parent)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        return lines[0]

    not_a_checkpoint = error_of(str(recipe), "--resume", str(recipe.parent / "corpus"))
    assert f"--resume {recipe.parent / 'corpus'}: is neither a checkpoint nor a run directory" in not_a_checkpoint
    wrong_shape = error_of("--run-dir", str(straight), "model.n_layers=3")
    assert "checkpoint has n_layers=2, recipe has 3" in wrong_shape
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    step4 = str(straight / "checkpoints" / "step-4")
    assert "needs a new directory" in error_of(str(recipe), "--resume", step4, "--run-dir", str(other))
    assert "has checkpoints after step 4 (step-8)" in error_of("--resume", step4)
    assert (straight / "metrics.jsonl").read_bytes() == metrics_before
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def test_branch_from_a_checkpoint_into_a_new_run_and_export(setup, tmp_path):
    recipe, straight, series = setup
    branch = tmp_path / "branch"
    done = run_cli("run", str(recipe), *STEPS, "--resume", str(straight / "checkpoints" / "step-6"),
                   "--run-dir", str(branch), cwd=recipe.parent)
    assert done.returncode == 0, done.stderr
    assert _series(branch) == [s for s in series if s[0] > 6]  # steps 7 and 8, as in the original

    out = tmp_path / "export"
    exported = run_cli("export", str(branch), "--format", "safetensors", "--out", str(out), cwd=recipe.parent)
    assert exported.returncode == 0, exported.stderr
    weights = load_file(out / "model.safetensors")
    final = _final_weights(straight)
    assert all(torch.equal(weights[k], final[k]) for k in weights)
