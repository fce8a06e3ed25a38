"""Slow reward functions in-process against `grpo.reward_workers` (trainbook/reward_pool.py), side
by side in one run: the time to score one rollout's completions, and the ratio.

Two kinds of slow: `verify` burns CPU on each completion (a checker written in Python), so workers
help up to the number of free cores; `judge` waits on each completion (a remote grader's latency,
modelled by a sleep), so workers help up to their number whatever the cores. The pool is started
before timing (start-up is paid once a run, not per rollout); each side scores the same
completions and must give the same scores.

    .venv/bin/python benchmarks/reward_pool.py [--completions 256] [--workers 2 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from trainbook.reward_pool import RewardPool
from trainbook.scoring import call_scorer, load_scorer

HERE = Path(__file__).resolve().parent


def verify(prompts, completions, **_):
    """CPU-bound: 60,000 steps of Python arithmetic a completion (about 9 ms on one core here)."""
    out = []
    for c in completions:
        acc = 0
        for i in range(60_000):
            acc = (acc * 31 + i + len(c)) % 1_000_003
        out.append(float(acc % 2))
    return out


def judge(prompts, completions, **_):
    """Latency-bound: 2 ms of waiting a completion."""
    time.sleep(0.002 * len(completions))
    return [float(len(c) % 2) for c in completions]


def timed(fn, repeats: int) -> tuple[float, list]:
    times, out = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--completions", type=int, default=256)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    os.chdir(HERE)  # the workers import this file as `reward_pool` from here
    completions = [f"{i} + {i} = {2 * i}" for i in range(args.completions)]
    prompts = ["q"] * len(completions)
    print(f"{args.completions} completions, {os.cpu_count()} cores, median of {args.repeats}")
    print(f"{'function':8} {'workers':>7} {'in-process s':>12} {'pool s':>8} {'speed-up':>8}")
    for name in ("verify", "judge"):
        spec = f"reward_pool:{name}"
        fn = load_scorer(spec)
        here_s, here = timed(lambda: call_scorer(fn, spec, prompts, completions, {}, allow_none=True), args.repeats)
        for n in args.workers:
            pool = RewardPool(n)
            pool.start()
            try:
                pool_s, there = timed(lambda: pool.score(spec, "bench", prompts, completions, {}), args.repeats)
            finally:
                pool.close()
            assert there == here, f"{name}: the pool's scores differ from the in-process ones"
            print(f"{name:8} {n:>7} {here_s:>12.3f} {pool_s:>8.3f} {here_s / pool_s:>7.2f}x")


if __name__ == "__main__":
    main()
