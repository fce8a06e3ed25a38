"""How closely a step's phases add up to its time, on the embedded default recipe.

Runs `trainbook run` (the real command) for 40 steps with `train.profile_phases=true`, a record
every step, an evaluation and a checkpoint every 10, and prints, per record and overall,
|sum(phases) - step_time_s| / step_time_s. The contract (DESIGN.md) is within 5%.

    .venv/bin/python benchmarks/phase_sum.py [--steps 40] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-shakespeare.toml"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cache", default=".trainbook/cache")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "trainbook", "run", str(RECIPE), f"train.max_steps={args.steps}",
                        "log.every_steps=1", "train.eval_every=10", "checkpoint.interval_steps=10",
                        "train.profile_phases=true", f"data.cache_dir={args.cache}", "--run-dir", str(run_dir)],
                       check=True, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    errors = [abs(sum(r["phases"].values()) - r["step_time_s"]) / r["step_time_s"] for r in train]
    worst = max(range(len(train)), key=errors.__getitem__)
    step_s = sum(r["step_time_s"] for r in train)
    phase_s = sum(sum(r["phases"].values()) for r in train)
    print(f"{len(train)} records: sum(phases) / step_time over the run = {phase_s / step_s:.5f}")
    print(f"max |sum(phases) - step_time_s| / step_time_s = {errors[worst]:.5f} (step {train[worst]['step']}, "
          f"{train[worst]['step_time_s']:.3f} s); median {sorted(errors)[len(errors) // 2]:.5f}")


if __name__ == "__main__":
    main()
