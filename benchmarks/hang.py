"""The hang watchdog: what it costs a healthy run, and how fast a hang is on screen.

1. Overhead: the default recipe on 2 ranks (`trainbook run --nproc 2`), watchdog off
   (`parallel.hang_timeout_s=0`: no thread, no flight recorder) against on, interleaved round by
   round (this machine is noisy). "on" is the default (hang_timeout_s = timeout_s / 2: a tick
   every 5 s) and a short timeout (`--short`, default 2 s: a tick every 0.2 s, the worst case).
   Tokens/s is the median of each run's logged steps after the first few; the ratio on/off per
   round, and the median ratio, are printed. Goal: >= 0.99.
2. Stall to verdict: rank 1 stops in data loading (fault point `data.next_batch`, action hang) and
   the seconds from that moment (the fault's REACHED file) to the verdict line on the terminal
   (stderr, read as it arrives) are printed, with the hang timeout they include.

    .venv/bin/python benchmarks/hang.py [--rounds 3] [--steps 40] [--short 2] [--hang-timeout 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GOAL = 0.99


def trainbook(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainbook", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def tokens_per_s(run_dir: Path, skip: int) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if r.get("kind") == "train" and r["step"] > skip]
    return statistics.median(rates)


def overhead(root: Path, common: list[str], rounds: int, steps: int, short: float) -> list[float]:
    variants = {"off": ["parallel.hang_timeout_s=0"], "on (default)": [],
                f"on ({short:g} s)": [f"parallel.hang_timeout_s={short}"]}
    ratios: dict[str, list[float]] = {k: [] for k in variants if k != "off"}
    for rnd in range(rounds):
        order = list(variants) if rnd % 2 == 0 else list(reversed(variants))
        rates = {}
        for name in order:
            run_dir = root / f"r{rnd}-{name.split()[0]}-{len(rates)}"
            proc = trainbook("run", *common, f"train.max_steps={steps}", "log.every_steps=1", *variants[name],
                             "--run-dir", str(run_dir), "--nproc", "2")
            _, err = proc.communicate()
            if proc.returncode != 0:
                sys.exit(f"{name}: exit {proc.returncode}\n{err}")
            rates[name] = tokens_per_s(run_dir, skip=5)
        line = " | ".join(f"{k} {rates[k]:,.0f} tok/s" for k in variants)
        for k in ratios:
            ratios[k].append(rates[k] / rates["off"])
        print(f"round {rnd + 1}: {line} | " + " | ".join(f"{k}/off {ratios[k][-1]:.4f}" for k in ratios), flush=True)
    for k, values in ratios.items():
        print(f"watchdog {k}: median tokens/s ratio on/off {statistics.median(values):.4f} over {rounds} rounds "
              f"(goal >= {GOAL})")
    return [statistics.median(v) for v in ratios.values()]


def stall_to_verdict(root: Path, common: list[str], hang_timeout: float) -> float:
    run_dir, reached = root / "hang", root / "hang.reached"
    env = {"TRAINBOOK_FAULT": "data.next_batch@5", "TRAINBOOK_FAULT_RANK": "1", "TRAINBOOK_FAULT_ACTION": "hang",
           "TRAINBOOK_FAULT_REACHED": str(reached)}
    proc = trainbook("run", *common, "train.max_steps=20", f"parallel.hang_timeout_s={hang_timeout}",
                     "--run-dir", str(run_dir), "--nproc", "2", env=env)
    seen: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stderr:
            if line.startswith("trainbook: error: "):
                seen.append((time.time(), line.strip()))

    reader = threading.Thread(target=read)
    reader.start()
    proc.wait()
    reader.join()
    if not seen:
        sys.exit(f"no verdict on screen (exit {proc.returncode})")
    at, line = seen[0]
    seconds = at - reached.stat().st_mtime
    print(line)
    print(f"stall to verdict on screen: {seconds:.2f} s (hang_timeout_s {hang_timeout:g} s + "
          f"{seconds - hang_timeout:.2f} s to detect, gather stacks and speak); every process gone "
          f"{time.time() - reached.stat().st_mtime:.2f} s after the stall; exit {proc.returncode}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--short", type=float, default=2.0, help="the short hang timeout compared too (s)")
    ap.add_argument("--hang-timeout", type=float, default=5.0, help="hang timeout of the stall run (s)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the default recipe")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        common = [f"run.runs_root={root / 'runs'}", "train.eval_every=0", *args.overrides]
        done = subprocess.run([sys.executable, "-m", "trainbook", "prepare", *common], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(done.stderr)
        ratios = overhead(root, common, args.rounds, args.steps, args.short)
        stall_to_verdict(root, common, args.hang_timeout)
    sys.exit(0 if min(ratios) >= GOAL else 1)


if __name__ == "__main__":
    main()
