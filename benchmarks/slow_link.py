"""A communication-bound run and the remedies `doctor` names for it, side by side in one invocation:
the default recipe's tiny Llama on 2 DDP ranks whose gradient all-reduces go over a link slowed on
purpose (the `comm.slow_link` fault: each completes late by its bytes over --mbps MB/s), first
uncompressed; `trainbook doctor` reads that run, and each remedy it names that sends fewer bytes
(`parallel.grad_compression`, `parallel.sync_every`) is then run on the same slowed link. Printed:
doctor's verdict and advice, and per run the bytes each rank sent per step (counted at the process
group), the mean step time after the first third of the steps, its grad_sync share, and the
speed-up over the uncompressed run.

    .venv/bin/python benchmarks/slow_link.py [--steps 30] [--mbps 20] [--cache /tmp/slow-link-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-shakespeare.toml"
DDP = ["parallel.data_parallel=ddp", "parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.count_grad_bytes=true"]


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainbook", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def train(overrides: list[str], steps: int, mbps: float, cache: Path, out: Path) -> dict:
    done = cli("run", str(RECIPE), f"train.max_steps={steps}", "log.every_steps=1", "train.eval_every=0",
               f"data.cache_dir={cache}", *DDP, *overrides, "--nproc", "2", "--run-dir", str(out),
               env={"TRAINBOOK_FAULT": "comm.slow_link", "TRAINBOOK_FAULT_LINK_MBPS": str(mbps)})
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    steady = records[len(records) // 3:]  # past DDP's start, its bucket rebuild and PowerSGD's warm-up
    return {"step_s": statistics.mean(r["step_time_s"] for r in steady),  # a mean: an outer step every H
            "bytes": statistics.mean(r["grad_bytes"] for r in steady),
            "grad_sync": sum(r["phases"]["grad_sync"] for r in steady) / sum(r["step_time_s"] for r in steady),
            "loss": records[-1]["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--mbps", type=float, default=20.0)
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "slow-link-cache")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {"none": train([], args.steps, args.mbps, args.cache, Path(tmp) / "none")}
        doctor = cli("doctor", str(Path(tmp) / "none"), env={})
        verdict = doctor.stdout.splitlines()[0]
        advice = next((line.strip() for line in doctor.stdout.splitlines() if line.strip().startswith("next:")), "")
        named = {f"grad_compression={mode}": [f"parallel.grad_compression={mode}",
                                              f"parallel.powersgd_start_step={args.steps // 3}"]
                 for mode in re.findall(r'parallel\.grad_compression = "(\w+)"', advice)}
        named.update({f"sync_every={h}": [f"parallel.sync_every={h}"]
                      for h in re.findall(r"parallel\.sync_every = (\d+)", advice)})
        for i, (name, overrides) in enumerate(named.items()):
            rows[name] = train(overrides, args.steps, args.mbps, args.cache, Path(tmp) / str(i))
    print(f"tiny-shakespeare on 2 DDP ranks, gradients over a link slowed to {args.mbps:g} MB/s, {args.steps} steps")
    print(f"doctor on the uncompressed run: {verdict}")
    print(f"  {advice}")
    if not named:
        raise SystemExit("doctor named no remedy that sends fewer bytes")
    base = rows["none"]
    print(f"{'remedy':<23} {'bytes/step':>11} {'step s':>7} {'grad_sync':>9} {'speed-up':>8} {'final loss':>11}")
    for mode, r in rows.items():
        print(f"{mode:<23} {r['bytes']:>11,.0f} {r['step_s']:>7.3f} {r['grad_sync']:>9.0%} "
              f"{base['step_s'] / r['step_s']:>7.2f}x {r['loss']:>11.4f}")


if __name__ == "__main__":
    main()
