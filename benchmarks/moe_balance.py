"""The tiny MoE recipe (recipes/moe-tiny-shakespeare.toml) trained with each way of balancing, side
by side in one invocation: the loss, the worst layer's load imbalance (max / mean tokens per
expert) and share of idle experts over the run's second half, and the expert alerts that fired.
One process, one thread, the default recipe's plays (prepared once into --cache).

    .venv/bin/python benchmarks/moe_balance.py [--steps 60] [--cache /tmp/moe-bench-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "moe-tiny-shakespeare.toml"
MODES = {
    "none": ["moe.balance=none"],
    "bias 0.001": ["moe.balance=bias", "moe.bias_update_rate=0.001"],
    "bias 0.01": ["moe.balance=bias", "moe.bias_update_rate=0.01"],
    "bias 0.05": ["moe.balance=bias", "moe.bias_update_rate=0.05"],
    "aux_loss 0.01": ["moe.balance=aux_loss", "moe.aux_loss_coef=0.01"],
    "aux_loss 0.1": ["moe.balance=aux_loss", "moe.aux_loss_coef=0.1"],
}


def train(overrides: list[str], steps: int, cache: Path, out: Path) -> dict:
    """One run of the recipe (`overrides`: its key=value overrides and any `trainbook run` option)."""
    cmd = [sys.executable, "-m", "trainbook", "run", str(RECIPE), f"train.max_steps={steps}", "log.every_steps=5",
           "train.eval_every=0", f"data.cache_dir={cache}", "--run-dir", str(out), *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    late = train[len(train) // 2:]
    alerts = [json.loads(line)["rule"] for line in (out / "events.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "alert"]
    return {"loss": train[-1]["loss"], "imbalance": statistics.mean(r["moe_imbalance"] for r in late),
            "idle": statistics.mean(r["moe_idle_frac"] for r in late),
            "alerts": ", ".join(sorted(set(alerts))) or "-", "step_s": statistics.median(r["step_time_s"] for r in train),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train[1:])}


def train_each(cases: dict[str, list[str]], doc: str, steps: int) -> tuple[int, dict[str, dict]]:
    """Parse --steps and --cache, then `train` each case (name -> its overrides) in turn:
    (steps, name -> its figures)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "moe-bench-cache")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        return args.steps, {name: train(o, args.steps, args.cache, Path(tmp) / str(i))
                            for i, (name, o) in enumerate(cases.items())}


def main() -> None:
    steps, rows = train_each(MODES, __doc__, 60)
    print(f"moe-tiny-shakespeare, {steps} steps x 2,048 tokens; imbalance and idle: mean over the second half")
    print(f"{'balance':<14} {'loss':>7} {'imbalance':>9} {'idle':>6} {'step s':>7}  alerts")
    for name, r in rows.items():
        print(f"{name:<14} {r['loss']:7.4f} {r['imbalance']:9.3f} {r['idle']:6.3f} {r['step_s']:7.3f}  {r['alerts']}")


if __name__ == "__main__":
    main()
