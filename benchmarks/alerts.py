"""How fast alerts arrive: a real `trainbook run` posting to a real HTTP server on 127.0.0.1.

1. NaN -> webhook: a NaN is put in a block's output in step N's forward (fault point
   `model.block_nan@N`); latency = the webhook's arrival at the server minus the end of step N
   (its `time` in metrics.jsonl, which is written every step here). Target <= 2 s.
2. Stall -> webhook: the loop blocks fetching step N's data (`data.next_batch@N`, action `wait`)
   until the benchmark creates the release file; latency = the stall alert's arrival minus
   (end of step N-1 + `alerts.stall_s`), i.e. how late after the configured stall time it comes.
   Target <= 1 s.

Both clocks are this machine's wall clock. Each measurement runs `--runs` times; the worst is
judged. Exits non-zero when a target is missed.

    .venv/bin/python benchmarks/alerts.py [--runs 3] [--stall-s 3]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.conftest import write_corpus, write_recipe  # noqa: E402

NAN_STEP, STALL_STEP = 5, 5


def serve() -> tuple[ThreadingHTTPServer, queue.Queue]:
    """An HTTP server that records (arrival time, JSON body) of every POST."""
    arrivals: queue.Queue = queue.Queue()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            arrivals.put((time.time(), json.loads(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, arrivals


def start_run(recipe: Path, run_dir: Path, url: str, fault: str, *overrides: str, **env: str) -> subprocess.Popen:
    env = {**os.environ, "TRAINBOOK_FAULT": fault, **env}
    args = [sys.executable, "-m", "trainbook", "run", str(recipe), "train.eval_every=0", "log.every_steps=1",
            f"alerts.webhook_url={url}", *overrides, "--run-dir", str(run_dir)]
    return subprocess.Popen(args, cwd=recipe.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def step_end(run_dir: Path, step: int) -> float:
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train" and record["step"] == step:
            return record["time"]
    raise RuntimeError(f"no metrics line for step {step} in {run_dir}")


def first(arrivals: queue.Queue, rule: str, step: int, timeout: float = 600) -> float:
    """Arrival time of the first `rule` alert for `step` (a busy machine may stall earlier too)."""
    while True:
        arrived, body = arrivals.get(timeout=timeout)
        if body["rule"] == rule and body["step"] == step:
            return arrived


def nan_latency(recipe: Path, tmp: Path, url: str, arrivals: queue.Queue, i: int) -> float:
    run_dir = tmp / f"nan{i}"
    proc = start_run(recipe, run_dir, url, f"model.block_nan@{NAN_STEP}", f"train.max_steps={NAN_STEP + 1}")
    arrived = first(arrivals, "nonfinite", NAN_STEP)
    if proc.wait() != 5:  # triage's default policy stops the run on a NaN (exit 5, errors.py)
        raise RuntimeError(proc.stderr.read().decode())
    return arrived - step_end(run_dir, NAN_STEP)


def stall_latency(recipe: Path, tmp: Path, url: str, arrivals: queue.Queue, i: int, stall_s: float) -> float:
    run_dir, release = tmp / f"stall{i}", tmp / f"release{i}"
    proc = start_run(recipe, run_dir, url, f"data.next_batch@{STALL_STEP}", f"train.max_steps={STALL_STEP}",
                     f"alerts.stall_s={stall_s}", "alerts.repeat_after_s=0", TRAINBOOK_FAULT_ACTION="wait", TRAINBOOK_FAULT_RELEASE=str(release))
    arrived = first(arrivals, "stall", STALL_STEP)
    release.touch()
    if proc.wait() != 0:
        raise RuntimeError(proc.stderr.read().decode())
    return arrived - (step_end(run_dir, STALL_STEP - 1) + stall_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stall-s", type=float, default=3.0)
    args = parser.parse_args()
    server, arrivals = serve()
    url = f"http://127.0.0.1:{server.server_address[1]}/alerts"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        recipe = write_recipe(tmp / "unit.toml", write_corpus(tmp / "corpus"))
        subprocess.run([sys.executable, "-m", "trainbook", "prepare", str(recipe)], check=True, capture_output=True)
        nan = [nan_latency(recipe, tmp, url, arrivals, i) for i in range(args.runs)]
        stall = [stall_latency(recipe, tmp, url, arrivals, i, args.stall_s) for i in range(args.runs)]
    server.shutdown()
    ok_nan, ok_stall = max(nan) <= 2.0, max(stall) <= 1.0
    print(f"NaN -> webhook: {', '.join(f'{x:.3f}' for x in nan)} s after the step ended "
          f"(worst {max(nan):.3f} s, target <= 2 s) {'ok' if ok_nan else 'MISSED'}")
    print(f"stall -> webhook: {', '.join(f'{x:.3f}' for x in stall)} s after stall_s = {args.stall_s:g} s "
          f"(worst {max(stall):.3f} s, target <= 1 s) {'ok' if ok_stall else 'MISSED'}")
    return 0 if ok_nan and ok_stall else 1


if __name__ == "__main__":
    sys.exit(main())
