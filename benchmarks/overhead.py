"""trainbook's real training loop against a bare, hand-written one: what does the framework cost?

The bare side is a nanoGPT-style loop written out here: the same model class and initial
weights, a `numpy.memmap` over the same token shard indexed by hand (the same sample order:
trainbook's documented permutation per epoch, reproduced in `bare_batches`), torch's AdamW with
the same parameter groups, the LR as a plain function, clipping, and a final `torch.save` of model
and optimizer as nanoGPT does. trainbook's side is `Trainer.fit()` on the default recipe, with its
logging cadence: metrics.jsonl, events.jsonl, the run log and the progress lines (sent to a file),
and its final checkpoint.

Each round runs both from the same initial weights for `--steps` steps, in alternating order
(this machine is noisy); only the loops are timed, not building the model. Every step's loss and
the final weights must be bitwise equal on both sides, else the comparison is void and the script
fails. It prints the ratio of tokens/s (trainbook / bare) per round and exits non-zero when the
median over rounds is below 0.97.

    .venv/bin/python benchmarks/overhead.py [--rounds 5] [--steps 60] [k=v ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from trainbook.commands.preflight import prepare_data
from trainbook.commands.recipe import default_recipe
from trainbook.commands.resolve import resolve
from trainbook.model import build_model
from trainbook.monitor import Sink
from trainbook.runs import create_run_dir
from trainbook.train.build import one_process

GOAL = 0.97


# ---- the bare loop ------------------------------------------------------------------------------

def bare_batches(shard: Path, seq_len: int, batch: int, seed: int, source: str):
    """(inputs, targets) of `batch` samples at a time, read from the shard file by hand.

    Sample i is tokens [i * T, i * T + T + 1); epoch e visits the samples in the permutation drawn
    from PCG64(SeedSequence([seed, crc32(source name), e])), as trainbook's loader documents."""
    index = json.loads(shard.with_suffix(".json").read_text())
    tokens = np.memmap(shard, dtype=np.dtype(index["dtype"]).newbyteorder("<"), mode="r")
    n = (len(tokens) - 1) // seq_len
    name_hash = zlib.crc32(source.encode("utf-8"))
    perms: dict[int, np.ndarray] = {}
    g = 0
    while True:
        rows = []
        for k in range(g, g + batch):
            epoch, position = divmod(k, n)
            if epoch not in perms:
                seq = np.random.SeedSequence([seed % (1 << 64), name_hash, epoch])
                perms = {e: p for e, p in perms.items() if e == epoch - 1}  # a batch may straddle two
                perms[epoch] = np.random.Generator(np.random.PCG64(seq)).permutation(n)
            start = int(perms[epoch][position]) * seq_len
            rows.append(np.asarray(tokens[start:start + seq_len + 1], dtype=np.int64))
        g += batch
        x = torch.from_numpy(np.stack(rows))  # (B, T + 1)
        yield x[:, :-1].contiguous(), x[:, 1:].contiguous()


def lr_at(step: int, peak: float, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Linear warmup, then cosine to min_ratio * peak."""
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    floor = peak * min_ratio
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def bare_loop(cfg, shard: Path, out: Path) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """Train like nanoGPT's train.py: every step's loss, the final weights, the seconds it took."""
    t, o, s = cfg.train, cfg.optim, cfg.schedule
    model = build_model(cfg.model, torch.device("cpu"), seed=cfg.run.seed)
    embedding = model.tok_embeddings.weight
    decay = [p for p in model.parameters() if p.ndim >= 2 and p is not embedding]
    no_decay = [p for p in model.parameters() if p.ndim < 2 or p is embedding]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    batches = bare_batches(shard, t.seq_len, t.micro_batch_size, cfg.run.seed, cfg.data.sources[0].name)
    accum = t.global_batch_tokens // (t.seq_len * t.micro_batch_size)
    losses = []
    start = time.perf_counter()
    for step in range(t.max_steps):
        lr = lr_at(step, o.lr, s.warmup_steps, t.max_steps, s.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros(())  # the step's mean loss, summed in float32 like the micro-batches
        for _ in range(accum):
            x, y = next(batches)
            logits = model(x)  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(0, 1))
            (loss / accum).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append((total / accum).item())
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, out)
    seconds = time.perf_counter() - start
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, seconds


# ---- trainbook ----------------------------------------------------------------------------------

class StepLosses(Sink):
    """A monitor like any other: keeps every step's loss (the metrics file has every 20th)."""

    def __init__(self):
        self.losses = []

    def on_step(self, report) -> None:
        self.losses.append(report.loss)


def trainbook_loop(cfg, data, run_dir: Path, console: Path):
    create_run_dir(run_dir.parent, "overhead", run_dir)  # as `trainbook run` makes it
    with open(console, "a") as out, contextlib.redirect_stdout(out):
        trainer = one_process(cfg, run_dir, data, torch.device("cpu"))
        steps = StepLosses()
        trainer.monitors.add(steps)
        start = time.perf_counter()
        trainer.fit()
        seconds = time.perf_counter() - start
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        trainer.close()
    return steps.losses, weights, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the default recipe")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per round and side")
    args = parser.parse_args()

    recipe = default_recipe()
    res = resolve(recipe, [*args.overrides, f"train.max_steps={args.steps}", "train.eval_every=0"], world_size=1)
    cfg = res.cfg
    if len(cfg.data.sources) != 1:
        sys.exit("the bare loop reads one source; this recipe has several")
    data = prepare_data(res, log=lambda *a: None)
    shards = sorted(Path(data.dir).glob("train-00-*.bin"))
    if len(shards) != 1:
        sys.exit(f"the bare loop reads one shard; the cache has {len(shards)}")
    t = cfg.train
    tokens = args.steps * res.tokens_per_step
    print(f"model {cfg.model.name}, {res.accum_steps} x {t.micro_batch_size} x {t.seq_len} tokens/step, "
          f"log every {cfg.log.every_steps} steps, {args.rounds} rounds x {args.steps} steps, "
          f"torch threads {torch.get_num_threads()}", flush=True)

    ratios, same = [], True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for i in range(args.rounds + 1):  # round 0 warms both up: allocator, thread pools
            sides = {}
            order = ["trainbook", "bare"] if i % 2 == 0 else ["bare", "trainbook"]
            for name in order:
                if name == "trainbook":
                    sides[name] = trainbook_loop(cfg, data, tmp / f"run-{i}", tmp / "console.txt")
                else:
                    sides[name] = bare_loop(cfg, shards[0], tmp / f"bare-{i}.pt")
            (tb_losses, tb_weights, tb_s), (bare_losses, bare_weights, bare_s) = sides["trainbook"], sides["bare"]
            equal = tb_losses == bare_losses and tb_weights.keys() == bare_weights.keys() and all(
                torch.equal(tb_weights[k], bare_weights[k]) for k in tb_weights)
            same = same and equal
            if i == 0:
                print(f"warm-up: losses and final weights bitwise equal: {equal}", flush=True)
                continue
            ratios.append(bare_s / tb_s)
            print(f"round {i}: trainbook {tokens / tb_s:,.0f} tok/s  bare {tokens / bare_s:,.0f} tok/s  "
                  f"ratio {ratios[-1]:.3f}  bitwise equal {equal}", flush=True)

    median = statistics.median(ratios)
    print(f"every step's loss and the final weights bitwise equal in every round: {same}")
    print(f"ratio (trainbook / bare tokens/s): median {median:.3f} over {len(ratios)} rounds "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); goal >= {GOAL}")
    if not same:
        print("FAIL: the two sides computed different things; the ratio means nothing")
        return 1
    if median < GOAL:
        print(f"FAIL: trainbook's loop costs more than {100 * (1 - GOAL):.0f}% over the bare loop")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
