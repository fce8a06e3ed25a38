"""What does monitoring cost? The default recipe with every monitor on against all of them off.

"On" is everything at its default cadence: TensorBoard scalars and histograms, the Prometheus
endpoint (scraped by nobody: serving is on demand), per-layer statistics every
`monitor.layer_stats_every` steps (default 100), every alert rule, and a webhook destination (a
real local HTTP server; a clean run fires nothing). "Off" turns those off; both sides keep what is
always written (metrics.jsonl, events.jsonl, logs, progress lines, MFU, per-rank figures).

Each round trains both sides from the same initial weights for `--steps` steps in alternating
order (this machine is noisy) and times `Trainer.fit()`. Losses must be bitwise equal on both
sides (monitors only read), else the script fails. It prints the ratio of tokens/s (on / off) per
round and exits non-zero when the median is below 0.99 (monitoring must cost at most 1%).

    .venv/bin/python benchmarks/monitoring.py [--rounds 3] [--steps 200] [k=v ...]
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trainbook.commands.preflight import prepare_data
from trainbook.commands.recipe import default_recipe
from trainbook.commands.resolve import resolve
from trainbook.monitor import Sink
from trainbook.runs import create_run_dir
from trainbook.train.build import one_process

GOAL = 0.99


class Losses(Sink):
    def __init__(self):
        self.losses = []

    def on_step(self, report) -> None:
        self.losses.append(report.loss)


class Hook(http.server.BaseHTTPRequestHandler):
    received = 0

    def do_POST(self):  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        Hook.received += 1
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(overrides: list[str], run_dir: Path, console: Path, data) -> tuple[list[float], float]:
    cfg = resolve(default_recipe(), overrides, world_size=1).cfg
    create_run_dir(run_dir.parent, "monitoring", run_dir)
    with open(console, "a") as out, contextlib.redirect_stdout(out):
        trainer = one_process(cfg, run_dir, data, torch.device("cpu"))
        losses = Losses()
        trainer.monitors.add(losses)
        start = time.perf_counter()
        try:
            trainer.fit()
            seconds = time.perf_counter() - start
        finally:
            trainer.close()  # also after a run that stops on a failure (its log handlers go)
    return losses.losses, seconds


def interleaved(rounds: int, common: list[str], on: Callable[[], list[str]], off: list[str], tmp: Path, data,
                tokens: int) -> tuple[list[float], bool]:
    """Both sides trained in each round, in alternating order (this machine is noisy), after a
    round 0 that warms both up: the on/off tokens/s ratio of each round, and whether every round's
    losses were bitwise equal on both sides. `on()` gives the "on" side's overrides of a round."""
    ratios, same = [], True
    for i in range(rounds + 1):
        sides = {}
        for name in (["on", "off"] if i % 2 == 0 else ["off", "on"]):
            sides[name] = train(common + (on() if name == "on" else off), tmp / f"{name}-{i}", tmp / "console.txt",
                                data)
        equal = sides["on"][0] == sides["off"][0]
        same = same and equal
        if i == 0:
            print(f"warm-up: losses bitwise equal: {equal}", flush=True)
            continue
        ratios.append(sides["off"][1] / sides["on"][1])
        print(f"round {i}: on {tokens / sides['on'][1]:,.0f} tok/s  off {tokens / sides['off'][1]:,.0f} tok/s  "
              f"ratio {ratios[-1]:.4f}  bitwise equal {equal}", flush=True)
    return ratios, same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("overrides", nargs="*", help="recipe overrides for both sides")
    args = parser.parse_args()

    server = http.server.HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    common = [*args.overrides, f"train.max_steps={args.steps}", "train.eval_every=0"]
    off = ["monitor.tensorboard=false", "monitor.layer_stats_every=0", "monitor.prometheus_port=0", "alerts.rules=[]"]
    res = resolve(default_recipe(), common, world_size=1)
    data = prepare_data(res, log=lambda *a: None)
    tokens = args.steps * res.tokens_per_step
    print(f"default recipe, {args.steps} steps x {res.tokens_per_step:,} tokens, {args.rounds} rounds; "
          f"on: layer statistics every {res.cfg.monitor.layer_stats_every} steps, TensorBoard, Prometheus, "
          f"alerts {res.cfg.alerts.rules} with a webhook", flush=True)

    on = lambda: ["monitor.tensorboard=true", f"monitor.prometheus_port={free_port()}",  # noqa: E731
                  f"alerts.webhook_url=http://127.0.0.1:{server.server_port}/hook"]
    with tempfile.TemporaryDirectory() as tmp:
        ratios, same = interleaved(args.rounds, common, on, off, Path(tmp), data, tokens)
    server.shutdown()

    median = statistics.median(ratios)
    print(f"webhooks received (a clean run fires no alert): {Hook.received}")
    print(f"ratio (monitoring on / off tokens/s): median {median:.4f} over {len(ratios)} rounds "
          f"(min {min(ratios):.4f}, max {max(ratios):.4f}); goal >= {GOAL}")
    if not same:
        print("FAIL: monitoring changed the training")
        return 1
    if median < GOAL:
        print(f"FAIL: monitoring costs more than {100 * (1 - GOAL):.0f}% of step time")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
