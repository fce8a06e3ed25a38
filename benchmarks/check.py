"""How long `trainbook check` takes on the default recipe: wall time and CPU time, as the real
command in a subprocess, against the 60 s preflight budget.

The data is prepared first (in a temporary cache) so every row runs, the loader and the training
probe of `bench data` included; then `check` runs on 1 rank and on `--nproc` ranks (collectives
and the per-rank matmul under torchrun), `--runs` times each. CPU time is the command's and its
children's (user + sys), so the torchrun workers count. Exits non-zero when a wall time exceeds
the budget.

    .venv/bin/python benchmarks/check.py [--runs 3] [--nproc 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUDGET_S = 60.0


def timed(args: list[str], cwd: Path) -> tuple[float, float, int, str]:
    """(wall s, CPU s of the command and its children, exit code, last line) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trainbook", *args], cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    last = (done.stdout.strip().splitlines() or [done.stderr.strip()])[-1]
    return wall, cpu, done.returncode, last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="trainbook-check-bench-") as tmp:
        cwd, cache = Path(tmp), f"data.cache_dir={Path(tmp) / 'cache'}"
        wall, cpu, code, _ = timed(["prepare", cache], cwd)
        assert code == 0, "prepare failed"
        print(f"prepare (once, not counted): {wall:.1f} s wall, {cpu:.1f} s CPU; {os.cpu_count()} CPUs")
        for nproc in (1, args.nproc):
            walls, cpus = [], []
            for _ in range(args.runs):
                wall, cpu, code, last = timed(["check", cache, "--nproc", str(nproc)], cwd)
                assert code in (0, 1), (code, last)
                walls.append(wall), cpus.append(cpu)
            med = statistics.median(walls)
            worst = max(worst, max(walls))
            print(f"check --nproc {nproc}: wall median {med:.1f} s (max {max(walls):.1f}), CPU median "
                  f"{statistics.median(cpus):.1f} s over {args.runs} runs; {med / BUDGET_S:.2f}x the "
                  f"{BUDGET_S:.0f} s budget; last line: {last}")
    return 0 if worst <= BUDGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
