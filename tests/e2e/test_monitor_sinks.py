"""The metric sinks of `[monitor]` through the real `trainbook run`: what TensorBoard, W&B and
MLflow hold, read back with each tool's own reader, equals metrics.jsonl; the Prometheus endpoint
of a live run, scraped over HTTP, equals its step in metrics.jsonl; a port or package that would
stop a sink is one line before anything is written."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import files_under, run_cli, run_cli_error, write_corpus, write_recipe
from tests.mlflow_server import MlflowServer
from tests.wandb_log import wandb_history, wandb_records
from trainbook.monitor.trackers import tracker_run_id
from trainbook.parallel.runtime import free_port

pytestmark = pytest.mark.slow

# What metrics.jsonl's train record calls each scalar the trackers log.
TRAIN_SCALARS = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
                 "train/tokens": "tokens", "train/tokens_per_s": "tokens_per_s",
                 "train/step_time_s": "step_time_s", "train/mem_peak_bytes": "mem_peak_bytes",
                 "train/data_wait_share": "data_wait_share"}
PHASES = ("data", "forward", "backward", "grad_sync", "optimizer", "checkpoint", "eval")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def expected_series(run_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, from metrics.jsonl."""
    out: dict[str, dict[int, float]] = {}
    for r in _jsonl(run_dir / "metrics.jsonl"):
        if r["kind"] == "eval":
            out.setdefault("val/loss", {})[r["step"]] = r["val_loss"]
            continue
        for tag, key in TRAIN_SCALARS.items():
            out.setdefault(tag, {})[r["step"]] = r[key]
        for phase in PHASES:
            out.setdefault(f"phase/{phase}_s", {})[r["step"]] = r["phases"][phase]
    return out


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One small run with TensorBoard, W&B (offline) and MLflow (its default local store) on."""
    tmp = tmp_path_factory.mktemp("sinks")
    recipe = write_recipe(tmp / "unit.toml", write_corpus(tmp / "corpus"))
    run_dir = tmp / "run"
    done = run_cli("run", str(recipe), "train.max_steps=4", "monitor.tensorboard=true", "monitor.wandb=true",
                   "monitor.mlflow=true", "--run-dir", str(run_dir), cwd=tmp, env={"WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stderr
    expected = expected_series(run_dir)
    assert sorted(expected["train/loss"]) == [2, 4] and sorted(expected["val/loss"]) == [0, 3, 4]
    return run_dir, expected


def test_tensorboard_holds_the_metrics(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    run_dir, expected = tracked_run
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    for tag, by_step in expected.items():
        got = {e.step: make_ndarray(e.tensor_proto).item() for e in acc.Tensors(tag)}
        assert got == by_step, tag


def test_wandb_offline_run_holds_the_metrics(tracked_run):
    run_dir, expected = tracked_run
    [log] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    got = wandb_history(log)
    for tag, by_step in expected.items():
        assert got[tag] == by_step, tag


def test_wandb_offline_run_of_two_processes_is_complete(tmp_path, recipe):
    """Under torchrun rank 0 ends with `os._exit`, which W&B's own exit hook never sees: the file
    still holds every step up to the last one, and the run's end (its exit record) last."""
    run_dir = tmp_path / "run"
    done = run_cli("run", str(recipe), "train.max_steps=3", "log.every_steps=1", "monitor.wandb=true",
                   "--run-dir", str(run_dir), "--nproc", "2", cwd=tmp_path, env={"WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stderr
    expected = expected_series(run_dir)
    assert sorted(expected["train/loss"]) == [1, 2, 3] and sorted(expected["val/loss"]) == [0, 3]
    [log] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    got = wandb_history(log)
    for tag, by_step in expected.items():
        assert got.get(tag) == by_step, tag
    *_, last = wandb_records(log)
    assert last.WhichOneof("record_type") == "exit" and last.exit.exit_code == 0, last


def test_mlflow_store_holds_the_metrics(tracked_run):
    from mlflow.tracking import MlflowClient

    run_dir, expected = tracked_run
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlruns' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("unit").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["trainbook.run_dir"] == str(run_dir.resolve())
    for tag, by_step in expected.items():
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, tag)}
        assert got == by_step, tag


def _run_log(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("rank0-*.log")))


def test_an_mlflow_server_that_holds_every_request_stalls_no_step(tmp_path, recipe):
    """The run waits after step 1 (a fault point) until the server holds the sink's first request;
    then, that request still unanswered, it trains and evaluates to its end."""
    release, go_on = threading.Event(), tmp_path / "go-on"
    run_dir = tmp_path / "run"
    with MlflowServer(hold=release) as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainbook", "run", str(recipe), "train.max_steps=4", "monitor.tensorboard=false",
             "monitor.mlflow=true", f"monitor.mlflow_tracking_uri={server.uri}", "--run-dir", str(run_dir)],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TRAINBOOK_FAULT": "train.after_step@1",
                 "TRAINBOOK_FAULT_ACTION": "wait", "TRAINBOOK_FAULT_RELEASE": str(go_on)})
        try:
            # Synchronise on events: the server's first request, then the run's last record (the
            # evaluation at step 4). The deadlines only bound a broken run.
            deadline = time.monotonic() + 240
            while not server.requests:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "the sink never sent its first request"
                time.sleep(0.2)
            go_on.touch()
            metrics = run_dir / "metrics.jsonl"
            while not (metrics.is_file() and '"kind": "eval", "step": 4' in metrics.read_text()):
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "the run never reached its last evaluation"
                time.sleep(0.2)
            assert server.requests == ["experiments/get-by-name"]
        finally:
            release.set()  # the server answers now: what the run queued goes out at its close
            go_on.touch()
            out, err = proc.communicate(timeout=240)
        [run] = server.runs.values()
    assert proc.returncode == 0, err
    expected = expected_series(run_dir)
    assert sorted(expected["train/loss"]) == [2, 4] and sorted(expected["val/loss"]) == [0, 3, 4]
    got: dict[str, dict[int, float]] = {}
    for key, step, value in run["metrics"]:
        got.setdefault(key, {})[step] = value
    for tag, by_step in expected.items():
        assert got[tag] == by_step, tag
    assert run["status"] == "FINISHED" and "monitor.mlflow" not in _run_log(run_dir)


def test_an_mlflow_server_that_is_gone_is_one_line_and_the_run_goes_on(tmp_path, recipe):
    port = free_port()  # nothing listens there
    run_dir = tmp_path / "run"
    # MLflow's own retries (7, with backoff) are the client's setting: none here, so it fails at once.
    done = run_cli("run", str(recipe), "train.max_steps=4", "monitor.tensorboard=false", "monitor.mlflow=true",
                   f"monitor.mlflow_tracking_uri=http://127.0.0.1:{port}", "--run-dir", str(run_dir), cwd=tmp_path,
                   env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    assert done.returncode == 0, done.stderr
    expected = expected_series(run_dir)
    assert sorted(expected["train/loss"]) == [2, 4] and sorted(expected["val/loss"]) == [0, 3, 4]
    log = _run_log(run_dir)
    [line] = [line for line in log.splitlines() if " WARNING " in line or "monitor.mlflow" in line]
    assert "WARNING monitor.mlflow: start failed, logging to it is off for the rest of the run: " in line
    assert f"127.0.0.1:{port}" in line and "Traceback" not in log + done.stderr


def _run_record(log: Path):
    return next(r.run for r in wandb_records(log) if r.WhichOneof("record_type") == "run")


def test_wandb_offline_after_a_kill_and_a_resume(tmp_path, recipe):
    """What the README says W&B does offline: each attempt its own offline run under the one id,
    marked as a resume; the killed attempt has no end and nothing past the kill (often nothing at
    all: W&B had not written its buffered records to the file); the resumed one holds every
    record metrics.jsonl has after the checkpoint it resumed from, then its end."""
    run_dir = tmp_path / "run"
    steps = ("train.max_steps=8", "checkpoint.interval_steps=2", "log.every_steps=1", "monitor.tensorboard=false",
             "monitor.wandb=true")
    # Held after step 5 (step 4's checkpoint committed) until W&B, which starts on the background
    # thread, has its file; then killed. The deadline only bounds a broken run.
    reached = tmp_path / "reached"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "TRAINBOOK_FAULT": "train.after_step@5",
           "TRAINBOOK_FAULT_ACTION": "wait", "TRAINBOOK_FAULT_RELEASE": str(tmp_path / "never"),
           "TRAINBOOK_FAULT_REACHED": str(reached)}
    proc = subprocess.Popen([sys.executable, "-m", "trainbook", "run", str(recipe), *steps, "--run-dir", str(run_dir)],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (reached.exists() and any((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the run never reached step 5 with W&B started"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    resumed = run_cli("run", "--run-dir", str(run_dir), cwd=tmp_path, env={"WANDB_MODE": "offline"})
    assert resumed.returncode == 0, resumed.stderr
    # Named offline-run-<start time>-<id>, then -1, -2 within one second: they sort in start order.
    killed_dir, resumed_dir = sorted((run_dir / "wandb").glob(f"offline-run-*-{tracker_run_id(run_dir)}*"))
    [second] = resumed_dir.glob("run-*.wandb")
    for log in [*killed_dir.glob("run-*.wandb"), second]:
        record = _run_record(log) if log.stat().st_size > 7 else None  # 7 bytes: the header alone
        assert record is None or (record.run_id == tracker_run_id(run_dir) and record.resume), record
        if log != second:
            before = list(wandb_records(log))
            assert "exit" not in {r.WhichOneof("record_type") for r in before}
            assert {r.history.step.num for r in before if r.WhichOneof("record_type") == "history"} <= set(range(6))
    assert _run_record(second).resume
    got = wandb_history(second)
    for tag, by_step in expected_series(run_dir).items():
        assert {s: v for s, v in got.get(tag, {}).items() if s > 4} == {s: v for s, v in by_step.items() if s > 4}, tag
    *_, last = wandb_records(second)
    assert last.WhichOneof("record_type") == "exit" and last.exit.exit_code == 0, last
    assert (f"monitor.wandb: offline, this attempt writes a new W&B run directory beside 1 of earlier attempts "
            f"(the same run id); `wandb sync {run_dir / 'wandb'}` uploads them as one run") in _run_log(run_dir)


# ---- Prometheus --------------------------------------------------------------------------------

def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed by the client library's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_endpoint_of_a_live_run(tmp_path, recipe):
    port = free_port()
    run_dir = tmp_path / "run"
    # The run stops answering after step 3 (the process stays alive, its server thread serving).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRAINBOOK_FAULT": "train.after_step@3",
           "TRAINBOOK_FAULT_ACTION": "hang"}
    proc = subprocess.Popen(
        # Evaluations at steps 0, 2, 4: the one the endpoint shows at step 3 finished before step 3 began.
        [sys.executable, "-m", "trainbook", "run", str(recipe), "train.max_steps=6", "log.every_steps=1",
         "train.eval_every=2",
         "monitor.tensorboard=false", f"monitor.prometheus_port={port}", "--run-dir", str(run_dir)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}/metrics"
    run = (("rank", "0"), ("run", "unit"))
    try:
        # Synchronise on the run itself: its step gauge (set last in a step) reads 3, and the
        # fault point keeps it there. The deadline only bounds a broken run.
        deadline = time.monotonic() + 240
        samples = {}
        while samples.get(("trainbook_step", run)) != 3:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the run never reached step 3"
            try:
                samples = scrape(url)
            except OSError:  # not serving yet: the run is still starting
                samples = {}
            time.sleep(0.2)
        step3 = next(r for r in _jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train" and r["step"] == 3)
        val2 = next(r for r in _jsonl(run_dir / "metrics.jsonl") if r["kind"] == "eval" and r["step"] == 2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    assert samples[("trainbook_loss", run)] == step3["loss"]
    assert samples[("trainbook_lr", run)] == step3["lr"]
    assert samples[("trainbook_grad_norm", run)] == step3["grad_norm"]
    assert samples[("trainbook_tokens", run)] == step3["tokens"]
    assert samples[("trainbook_tokens_per_second", run)] == step3["tokens_per_s"]
    assert samples[("trainbook_step_time_seconds", run)] == step3["step_time_s"]
    assert samples[("trainbook_memory_peak_bytes", run)] == step3["mem_peak_bytes"]
    assert samples[("trainbook_data_wait_share", run)] == step3["data_wait_share"]
    assert samples[("trainbook_val_loss", run)] == val2["val_loss"]
    for phase in PHASES:
        assert samples[("trainbook_phase_seconds", (("phase", phase), *run))] == step3["phases"][phase]
    assert ("trainbook_mfu", run) not in samples if step3["mfu"] is None else \
        samples[("trainbook_mfu", run)] == step3["mfu"]


def test_prometheus_port_in_use_is_one_line_before_anything(tmp_path, recipe):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = run_cli_error("run", str(recipe), f"monitor.prometheus_port={port}", cwd=tmp_path)
        assert f"command line: monitor.prometheus_port: cannot serve on port {port} of 127.0.0.1" in line
        in_file = tmp_path / "in-file.toml"
        in_file.write_text(f'extends = "{recipe.name}"\n\n[monitor]\nprometheus_port = {port}\n')
        line = run_cli_error("run", str(in_file), cwd=tmp_path)
        assert f"{in_file}: monitor.prometheus_port: cannot serve on port {port} of 127.0.0.1" in line
    assert not (tmp_path / "runs").exists()


def test_prometheus_host_not_of_this_machine_is_one_line(tmp_path, recipe):
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this machine.
    line = run_cli_error("run", str(recipe), "monitor.prometheus_port=9", "monitor.prometheus_host=192.0.2.1",
                         cwd=tmp_path)
    assert "command line: monitor.prometheus_host: cannot bind 192.0.2.1" in line


@pytest.mark.parametrize("key", ["wandb", "mlflow"])
def test_missing_tracker_package_is_one_line(tmp_path, recipe, key):
    """The real command in a Python where the package cannot be imported (None in sys.modules)."""
    before = files_under(tmp_path)
    code = f"import sys; sys.modules[{key!r}] = None; sys.argv[0] = 'trainbook'; from trainbook.cli import main; main()"
    done = subprocess.run([sys.executable, "-c", code, "run", str(recipe), f"monitor.{key}=true"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.splitlines() == [
        f"trainbook: error: command line: monitor.{key}: {key} is not installed: pip install 'trainbook[{key}]'"]
    assert files_under(tmp_path) == before
