"""trainbook against torchtitan 0.3.0 on torchtitan's llama3 "debugmodel" shape, interleaved.

    python benchmarks/throughput.py --peer ~/.cache/tt-peer [--rounds 2] [--steps 10]

The peer is torchtitan 0.3.0 run on CPU from outside by the harness in ../shared/peers/
torchtitan-cpu (set it up once with its setup.sh; pass its folder as --peer). Each round trains,
one after the other on the same cores: torchtitan (eager: its default), trainbook as a recipe runs
by default (`train.compile = auto`), and trainbook eager (`train.compile = false`). Same shape, batch
and precision (fp32) everywhere: dim 256, 6 layers, 16 heads, FFN 768, vocab 2048, untied, 8
sequences of 2048 tokens a step. Figures are the median tokens/s of steps 3 and later (compile
time is in no step: trainbook compiles before step 1, torchtitan's eager run compiles nothing).
The ratios are per round, trainbook / torchtitan. MFU (6N + attention FLOPs per token, as
torchtitan counts them) is against one peak for all three: the best of the matmul probe
(monitor/flops.py, 1024x1024 fp32, chained) measured by this script before and after the rounds,
so a probe slowed by a busy moment in one run cannot inflate that run's MFU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from trainbook.config.model import ModelConfig  # noqa: E402
from trainbook.model.registry import resolve  # noqa: E402
from trainbook.model import flops_per_token  # noqa: E402
from trainbook.monitor.flops import matmul_flops  # noqa: E402

HARNESS = REPO.parent / "shared" / "peers" / "torchtitan-cpu"
SHAPE = ["model.dim=256", "model.n_layers=6", "model.n_heads=16", "model.n_kv_heads=16", "model.ffn_dim=768",
         "model.vocab_size=2048", "model.tie_embeddings=false", "model.rope_theta=500000", "model.max_seq_len=2048",
         "tokenizer.vocab_size=2048", "train.seq_len=2048", "train.micro_batch_size=8",
         "train.global_batch_tokens=16384", "precision.dtype=fp32", "optim.lr=8e-4", "schedule.warmup_steps=2",
         "train.eval_every=0", "log.every_steps=1", "checkpoint.interval_steps=0"]


def torchtitan(harness: Path, peer: Path, steps: int) -> float:
    done = subprocess.run(["bash", str(harness / "run.sh"), str(peer), str(steps)],
                          capture_output=True, text=True, check=True)
    rates = {int(p[1]): float(p[3]) for p in (line.split() for line in done.stdout.splitlines()) if p[:1] == ["step"]}
    return statistics.median(v for k, v in rates.items() if k >= 3)


FLOPS_PER_TOKEN = flops_per_token(resolve(ModelConfig(
    name="tiny", dim=256, n_layers=6, n_heads=16, n_kv_heads=16, ffn_dim=768, vocab_size=2048,
    tie_embeddings=False, max_seq_len=2048)), 2048)


def peak() -> float:
    return matmul_flops(torch.device("cpu"), "fp32", 1024, reps=20)


def trainbook(steps: int, compile_setting: str | None, runs: Path) -> tuple[float, str]:
    run_dir = runs / f"tb-{compile_setting or 'default'}-{len(list(runs.iterdir()))}"
    extra = [f"train.compile={compile_setting}"] if compile_setting else []
    cmd = [sys.executable, "-m", "trainbook", "run", *SHAPE, f"train.stop_at_step={steps}", *extra,
           "--run-dir", str(run_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"trainbook failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train" and r["step"] >= 3]
    choice = next((line for line in done.stdout.splitlines() if line.startswith("compile ")), "")
    return statistics.median(r["tokens_per_s"] for r in train), choice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", type=Path, required=True, help="the folder torchtitan-cpu's setup.sh filled")
    ap.add_argument("--harness", type=Path, default=HARNESS, help="the torchtitan-cpu harness (its run.sh)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp)
        # Prepare the data (a 2048-token BPE of the plays) outside any timing.
        subprocess.run([sys.executable, "-m", "trainbook", "prepare", *SHAPE], check=True, capture_output=True)
        before = peak()
        rounds = []
        for r in range(1, args.rounds + 1):
            tt = torchtitan(args.harness, args.peer, args.steps)
            tb, choice = trainbook(args.steps, None, runs)
            eager, _ = trainbook(args.steps, "false", runs)
            rounds.append((tt, tb, eager))
            print(f"round {r}: torchtitan eager {tt:,.0f} tokens/s | trainbook default {tb:,.0f} | trainbook eager "
                  f"{eager:,.0f} | default/torchtitan {tb / tt:.2f}x, eager/torchtitan {eager / tt:.2f}x", flush=True)
        best = max(before, peak())
        print(f"trainbook default: {choice}")
        print(f"MFU against the matmul probe's {best / 1e9:.0f} GFLOP/s ({FLOPS_PER_TOKEN / 1e6:.1f} MFLOP per token), "
              "median over rounds: " + ", ".join(
                  f"{name} {statistics.median(r[i] for r in rounds) * FLOPS_PER_TOKEN / best:.1%}"
                  for i, name in enumerate(("torchtitan", "trainbook default", "trainbook eager"))))
        print("ratio default/torchtitan per round: " + ", ".join(f"{tb / tt:.2f}x" for tt, tb, _ in rounds))


if __name__ == "__main__":
    main()
