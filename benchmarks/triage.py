"""What does NaN and spike triage cost, and how soon is a bad step written up?

1. Overhead: the default recipe with triage judging every step (`on_nonfinite = "stop"`, and
   `on_spike = "skip"` so the robust spike rule runs too) against triage off (both `ignore`),
   trained from the same weights in alternating order (this machine is noisy), `Trainer.fit()`
   timed. Clean runs: losses must be bitwise equal on both sides (judging only reads), else the
   script fails. Prints the tokens/s ratio (on / off) per round; exits non-zero when the median is
   below 0.99 (the check must cost at most 1% of step time).
   Whole-run timings on this shared machine swing by more than 1% from run to run, so the
   judgement is also timed alone: `Triage.judge` + `accept` (the per-step work triage adds to a
   clean step, the spike rule over a full window included) on the losses of a real run, as a
   share of that run's median step time.
2. Latency: the same recipe with NaN put into block 1's output at step `--nan-step`: the seconds
   from the end of the step before it (its metrics.jsonl record) to the `incident` event, which is
   written once the incident directory is complete. That span holds the bad step itself, its
   re-run with a hook on every module, and the writing; the clean step time is printed beside it.

    .venv/bin/python benchmarks/triage.py [--rounds 3] [--steps 200] [--nan-step 50] [k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from monitoring import interleaved, train  # benchmarks/ is the script's own directory

from trainbook.commands.preflight import prepare_data
from trainbook.commands.recipe import default_recipe
from trainbook.commands.resolve import resolve
from trainbook.errors import DiagnosedFailure

GOAL = 0.99
ON = ["triage.on_nonfinite=stop", "triage.on_spike=skip"]
OFF = ["triage.on_nonfinite=ignore", "triage.on_spike=ignore"]


def latency(common: list[str], nan_step: int, run_dir: Path, console: Path, data) -> tuple[float, float]:
    """(seconds from step nan_step - 1's record to the incident event, median clean step time)."""
    os.environ.update(TRAINBOOK_FAULT=f"model.block_nan@{nan_step}", TRAINBOOK_FAULT_BLOCK="1")
    try:
        train(common + ON + [f"train.max_steps={nan_step + 1}", "log.every_steps=1"], run_dir, console, data)
        raise RuntimeError("the NaN did not stop the run")
    except DiagnosedFailure:
        pass
    finally:
        del os.environ["TRAINBOOK_FAULT"], os.environ["TRAINBOOK_FAULT_BLOCK"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    before = next(r["time"] for r in records if r["kind"] == "train" and r["step"] == nan_step - 1)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    incident = next(e["time"] for e in events if e["kind"] == "incident")
    step_time = statistics.median(r["step_time_s"] for r in records if r["kind"] == "train" and r["step"] < nan_step)
    return incident - before, step_time


def judge_cost(losses: list[float], lrs: list[float], res) -> float:
    """Median seconds of one clean step's judgement (one process: no agreement collective)."""
    import time

    from trainbook.diagnose.triage import Triage
    from trainbook.parallel.dims import ParallelDims
    from trainbook.parallel.runtime import Runtime
    from trainbook.runs import RunPaths

    cfg = res.cfg.triage.model_copy(update={"on_nonfinite": "stop", "on_spike": "skip"})
    triage = Triage(cfg, Runtime(0, 1, ParallelDims(1, 1, 1, 1), torch.device("cpu")), RunPaths.of("."), None, None, 1)
    seconds = []
    for loss, lr in zip(losses, lrs):
        start = time.perf_counter()
        verdict = triage.judge(loss, 1.0, lr)
        triage.accept(loss, lr)
        seconds.append(time.perf_counter() - start)
        assert verdict is None or verdict.kind == "spike", verdict  # a clean run: no NaN
    return statistics.median(seconds[cfg.window:])  # once the spike rule judges: its full cost


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nan-step", type=int, default=50)
    parser.add_argument("overrides", nargs="*", help="recipe overrides for both sides")
    args = parser.parse_args()

    common = [*args.overrides, "train.eval_every=0", "monitor.layer_stats_every=0"]
    res = resolve(default_recipe(), common + [f"train.max_steps={args.steps}"], world_size=1)
    data = prepare_data(res, log=lambda *a: None)
    tokens = args.steps * res.tokens_per_step
    print(f"default recipe, {args.steps} steps x {res.tokens_per_step:,} tokens, {args.rounds} rounds; "
          f"on: {' '.join(ON)}; off: {' '.join(OFF)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ratios, same = interleaved(args.rounds, common + [f"train.max_steps={args.steps}", "log.every_steps=1"],
                                   lambda: ON, OFF, tmp, data, tokens)
        spans = [latency(common, args.nan_step, tmp / f"nan-{i}", tmp / "console.txt", data) for i in range(args.rounds)]
        records = [json.loads(line) for line in (tmp / "on-1" / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["kind"] == "train"]
    step_s = statistics.median(r["step_time_s"] for r in train)
    # The LR held: the spike rule judges from its first full window on (not only after the warmup).
    per_step = judge_cost([r["loss"] for r in train], [1.0] * len(train), res)

    median = statistics.median(ratios)
    print(f"ratio (triage on / off tokens/s): median {median:.4f} over {len(ratios)} rounds "
          f"(min {min(ratios):.4f}, max {max(ratios):.4f}); goal >= {GOAL}")
    print(f"judging a clean step alone: {per_step * 1e6:.0f} us per step (median, spike rule on a full window) = "
          f"{per_step / step_s:.3%} of the median step ({step_s:.3f} s, {len(train)} logged steps)")
    print("NaN at step {}: incident written {} s after the step before it ended (clean step {} s)".format(
        args.nan_step, ", ".join(f"{s:.3f}" for s, _ in spans), ", ".join(f"{t:.3f}" for _, t in spans)))
    if not same:
        print("FAIL: triage changed the training")
        return 1
    if median < GOAL:
        print(f"FAIL: triage costs more than {100 * (1 - GOAL):.0f}% of step time")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
