"""What the straggler probes cost: 2-rank runs with the `straggler` rule on and off, side by side.

A probed step runs 2 + accumulation probes, each a device sync and a one-element all-reduce of the
world (train/stragglers.py). This runs the default recipe as `trainbook run --nproc 2` (gloo),
every step logged and probed (`log.every_steps=1`: the worst case), in alternating order per round
(this machine is noisy), and reads each run's metrics.jsonl:

- the losses and gradient norms of both sides must be bitwise equal (the probes touch no training
  value), else the script fails;
- the median step time of steps 3.. per side, the ratio on / off per round and its median;
- the cost of one probe: (median on - median off) / probes per step, and what that makes per step
  at the default logging cadence and `alerts.straggler_every`.

    .venv/bin/python benchmarks/stragglers.py [--rounds 4] [--steps 30] [k=v ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from trainbook.config.monitor import ALERT_RULES

OFF = "alerts.rules=[" + ", ".join(f'"{r}"' for r in ALERT_RULES if r != "straggler") + "]"


def run(tmp: Path, name: str, steps: int, cache: Path, extra: list[str], rule_off: bool) -> list[dict]:
    run_dir = tmp / name
    argv = [sys.executable, "-m", "trainbook", "run", f"train.max_steps={steps}", "log.every_steps=1",
            "train.eval_every=0", f"data.cache_dir={cache}", *extra, *([OFF] if rule_off else []),
            "--nproc", "2", "--run-dir", str(run_dir)]
    done = subprocess.run(argv, cwd=tmp, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("overrides", nargs="*", help="key=value for the default recipe")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        cache = tmp / "cache"
        subprocess.run([sys.executable, "-m", "trainbook", "prepare", f"data.cache_dir={cache}"], cwd=tmp,
                       check=True, capture_output=True)
        resolved = subprocess.run([sys.executable, "-m", "trainbook", "config", *args.overrides], cwd=tmp,
                                  check=True, capture_output=True, text=True).stdout
        ratios, costs = [], []
        for i in range(args.rounds):
            sides = {}
            for side in (("off", "on") if i % 2 == 0 else ("on", "off")):
                sides[side] = run(tmp, f"{side}-{i}", args.steps, cache, args.overrides, rule_off=side == "off")
            on, off = sides["on"], sides["off"]
            same = [(a["loss"], a["grad_norm"]) for a in on] == [(b["loss"], b["grad_norm"]) for b in off]
            if not same:
                sys.exit(f"round {i}: the losses or gradient norms of the two sides differ: void")
            t_on = statistics.median(r["step_time_s"] for r in on[2:])
            t_off = statistics.median(r["step_time_s"] for r in off[2:])
            ratios.append(t_on / t_off)
            costs.append(t_on - t_off)
            print(f"round {i + 1}: step time on {t_on * 1e3:.2f} ms, off {t_off * 1e3:.2f} ms, on/off {t_on / t_off:.4f}"
                  f" (losses and grad norms bitwise equal)")
    accum = int(_key(resolved, "gradient_accumulation", "1"))
    probes = 2 + accum
    cost = statistics.median(costs)
    every = int(_key(resolved, "every_steps", "10"))
    print(f"median on/off {statistics.median(ratios):.4f}; a probed step costs {cost * 1e3:.2f} ms more "
          f"({probes} probes: {cost / probes * 1e6:.0f} us each); at log.every_steps={every}, "
          f"straggler_every=1, {cost / every * 1e3:.3f} ms per step on average")


def _key(toml: str, key: str, default: str) -> str:
    """The first `key = value` of a resolved config's TOML text (or `default`)."""
    for line in toml.splitlines():
        name, _, value = line.partition("=")
        if name.strip() == key:
            return value.strip()
    return default


if __name__ == "__main__":
    main()
