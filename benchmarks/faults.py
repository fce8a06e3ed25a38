"""What does a failed worker cost? Goodput and recovery time of elastic restarts.

The default recipe on `--nproc` ranks (CPU, gloo) for `--steps` steps, checkpointing every
`--checkpoint-every` steps, run side by side in one invocation:

- clean: no failure, no restarts;
- for each M of `--every`: a worker (a random rank, seeded) SIGKILLs itself after every M-th step
  (fault point `train.after_step@k*M:rR:aA`, one per elastic attempt), under `--max-restarts`
  enough for all of them.

For each run it prints the goodput, time that produced kept steps (the step times of the final
metrics.jsonl, whose lines a restart rewound are gone) over the wall time of the whole command,
and its ratio to the clean run's; and for the faulty runs the recovery time of each failure, from
the agent's `worker_failed` event (at most one agent poll, 0.5 s, after the kill) to the next
completed step's record, median and worst, with the part of it the new workers spent from their
process start to their first step (`restart` event `process_started`).

    .venv/bin/python benchmarks/faults.py [--steps 100] [--every 20,50] [--nproc 2] [k=v ...]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainbook.monitor.archive import read_jsonl


def run(run_dir: Path, args: list[str], fault: str | None, restarts: int, nproc: int) -> float:
    """Wall seconds of one `trainbook run` of the default recipe."""
    env = {**os.environ, "TRAINBOOK_FAULT": fault} if fault else None
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trainbook", "run", *args, "--nproc", str(nproc),
                           "--max-restarts", str(restarts), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        sys.exit(f"{run_dir.name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return wall


def measure(run_dir: Path, wall: float) -> dict:
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    events = read_jsonl(run_dir / "events.jsonl")
    failed = [e for e in events if e["kind"] == "worker_failed"]
    restarts = [e for e in events if e["kind"] == "restart"]
    recovery, startup = [], []
    for f, r in zip(failed, restarts):
        # The next completed step: the first record written after the restart event.
        after = [t["time"] for t in train if t["time"] > r["time"]]
        if after:
            recovery.append(after[0] - f["time"])
            if r.get("process_started"):
                startup.append(after[0] - r["process_started"])
    return {"goodput": sum(t["step_time_s"] for t in train) / wall, "wall": wall, "steps": len(train),
            "failures": len(failed), "recovery": recovery, "startup": startup}


def _spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.2f} s, worst {max(xs):.2f} s" if xs else "none"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", default="20,50", help="kill a worker after every M-th step; comma-separated")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    common = [f"train.max_steps={args.steps}", f"checkpoint.interval_steps={args.checkpoint_every}",
              "log.every_steps=1", "train.eval_every=0", *args.overrides]
    subprocess.run([sys.executable, "-m", "trainbook", "prepare", *args.overrides], check=True, capture_output=True)
    with tempfile.TemporaryDirectory() as tmp:
        clean_dir = Path(tmp) / "clean"
        clean = measure(clean_dir, run(clean_dir, common, None, 0, args.nproc))
        print(f"clean: {clean['steps']} steps in {clean['wall']:.1f} s, goodput {clean['goodput']:.3f}")
        for every in (int(m) for m in args.every.split(",")):
            kills = list(range(every, args.steps, every))
            fault = ",".join(f"train.after_step@{s}:r{rng.randrange(args.nproc)}:a{a}" for a, s in enumerate(kills))
            run_dir = Path(tmp) / f"every-{every}"
            got = measure(run_dir, run(run_dir, common, fault, len(kills), args.nproc))
            assert got["steps"] == args.steps and got["failures"] == len(kills), got
            print(f"a worker killed every {every} steps ({got['failures']} kills): {got['wall']:.1f} s, "
                  f"goodput {got['goodput']:.3f} = {got['goodput'] / clean['goodput']:.3f} of the clean run's; "
                  f"recovery (kill to next step) {_spread(got['recovery'])}; "
                  f"of it, new process start to first step {_spread(got['startup'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
