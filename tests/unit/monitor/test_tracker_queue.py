"""The trackers behind the background queue, against a real MLflow REST server on 127.0.0.1
(tests/mlflow_server.py): a server that holds every request holds up no report, and gets every
record once it answers; a server that is gone is one warning line; a full queue drops and counts."""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import replace

import pytest

from tests.mlflow_server import MlflowServer
from tests.unit.monitor.test_metric_sinks import REPORT
from trainbook.monitor import Alert, EvalReport
from trainbook.monitor.external import Tracked
from trainbook.monitor.scalars import step_scalars
from trainbook.monitor.trackers import MlflowSink
from trainbook.runs import RunPaths

STEPS = 20


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture
def log():
    logger = logging.getLogger("trainbook.test-tracker-queue")
    handler = Lines()
    logger.addHandler(handler)
    yield logger, handler.lines
    logger.removeHandler(handler)


def mlflow(tmp_path, uri: str, logger, cls=Tracked) -> Tracked:
    return cls("monitor.mlflow", lambda: MlflowSink(RunPaths.of(tmp_path), uri, "exp", "run", 1, STEPS), 60.0, logger)


def feed(sink: Tracked, steps: int = STEPS) -> None:
    for step in range(1, steps + 1):
        sink.on_step(replace(REPORT, step=step))
    sink.on_eval(EvalReport(step=steps, val_loss=3.5, time=REPORT.time))
    sink.on_alert(Alert(run="exp", rank=0, rule="stall", value=None, step=steps, time=REPORT.time, message="m"))


def test_a_server_that_holds_every_request_holds_up_no_report(tmp_path, log):
    logger, lines = log
    release = threading.Event()
    with MlflowServer(hold=release) as server:
        sink = mlflow(tmp_path, server.uri, logger)
        assert server.received.wait(60)  # the start's first request is in, and held
        feed(sink)  # returns with that request still unanswered: nothing here waited for it
        assert server.requests == ["experiments/get-by-name"]
        release.set()
        sink.close()
        [run] = server.runs.values()
    assert run["status"] == "FINISHED" and run["tags"]["alert.stall"] == f"step {STEPS}: m"
    want = {(key, step): value for step in range(1, STEPS + 1) for key, value in step_scalars(REPORT).items()}
    want |= {("val/loss", STEPS): 3.5, ("alerts/stall", STEPS): 1.0}
    assert sorted(run["metrics"]) == sorted((key, step, value) for (key, step), value in want.items())
    assert lines == []


def test_a_server_that_is_gone_is_one_line_and_nothing_raises(tmp_path, log, monkeypatch):
    # The client's own retries (default 7, with backoff: minutes) are its setting; none here.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    logger, lines = log
    sink = mlflow(tmp_path, f"http://127.0.0.1:{port}", logger)
    feed(sink)
    sink.close()
    assert len(lines) == 1, lines
    assert lines[0].startswith("WARNING monitor.mlflow: start failed, logging to it is off for the rest of the run: ")
    assert f"127.0.0.1:{port}" in lines[0] and "training goes on" in lines[0]


def test_a_full_queue_drops_the_newest_and_counts_them(tmp_path, log):
    class Small(Tracked):
        size = 10

    logger, lines = log
    release = threading.Event()
    with MlflowServer(hold=release) as server:
        sink = mlflow(tmp_path, server.uri, logger, cls=Small)
        assert server.received.wait(60)  # the thread holds the start: the queue is empty
        feed(sink, steps=13)  # 13 steps, an eval and an alert: 10 fit
        release.set()
        sink.close()
        [run] = server.runs.values()
    assert sorted({step for key, step, _ in run["metrics"] if key == "train/loss"}) == list(range(1, 11))
    assert run["status"] == "FINISHED"  # the close waited for room
    assert lines == [
        "WARNING monitor.mlflow: 10 records are waiting; step 11 dropped, and every one after it while the "
        "queue is full (counted at the end)",
        "WARNING monitor.mlflow: 5 records dropped because the queue was full"]
