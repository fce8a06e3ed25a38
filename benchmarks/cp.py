"""Context parallelism against one process and against FSDP on the same two ranks, at a long
sequence, side by side in one invocation: the default recipe's tiny Llama on its plays with
sequences of --seq-len tokens (2 per step), each layout reading the same global batch; the median
step time and tokens/s after the first step, the ratio to one process, the largest peak memory of a
rank, and the final loss.

    .venv/bin/python benchmarks/cp.py [--seq-len 8192] [--steps 6] [--cache /tmp/cp-bench-cache]

On a CPU the 2 ranks share the machine's cores (one thread each): the step time is the cost of the
layout's communication and of each rank's extra work, not a speed-up. What context parallelism buys
is the memory: each rank keeps the activations of half of each sequence (plus every key and value).
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

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-shakespeare.toml"
LAYOUTS = {
    "one process": [],
    "fsdp x 2": ["--nproc", "2"],
    "cp x 2": ["parallel.cp=2", "parallel.dp_shard=1", "--nproc", "2"],
    "cp x 2, contiguous": ["parallel.cp=2", "parallel.dp_shard=1", "parallel.cp_load_balance=none", "--nproc", "2"],
}


def train(overrides: list[str], seq_len: int, steps: int, cache: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "trainbook", "run", str(RECIPE), f"train.max_steps={steps}", "log.every_steps=1",
           "train.eval_every=0", f"train.seq_len={seq_len}", f"model.max_seq_len={seq_len}",
           f"train.global_batch_tokens={2 * seq_len}", "train.micro_batch_size=1", "train.compile=false",
           f"data.cache_dir={cache}", "--run-dir", str(out), *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    peaks = [(r.get("ranks") or {}).get("mem_peak_bytes", {}).get("max", r.get("mem_peak_bytes")) for r in records]
    return {"step_s": statistics.median(r["step_time_s"] for r in records[1:]),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[1:]),
            "peak": max(p for p in peaks if p is not None), "loss": records[-1]["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "cp-bench-cache")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: train(o, args.seq_len, args.steps, args.cache, Path(tmp) / str(i))
                for i, (name, o) in enumerate(LAYOUTS.items())}
    base = rows["one process"]
    print(f"tiny-shakespeare, 2 sequences of {args.seq_len} a step, {args.steps} steps; medians after step 1")
    print(f"{'layout':<20} {'step s':>7} {'tokens/s':>9} {'vs one':>7} {'peak MiB':>9} {'final loss':>11}")
    for name, r in rows.items():
        print(f"{name:<20} {r['step_s']:7.3f} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / base['tokens_per_s']:7.2f} "
              f"{r['peak'] / 2**20:9.0f} {r['loss']:11.6f}")


if __name__ == "__main__":
    main()
