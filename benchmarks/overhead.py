"""trainbook's training step against a bare PyTorch loop: same model, data, optimizer, accumulation.

Both run interleaved in one process (this machine is noisy), in blocks of a few steps, and the
script prints trainbook's tokens/s as a ratio of the bare loop's. trainbook's side is the
Trainer's real per-step path: LR schedule, train_step with phase timing, StepReport, and the
metrics/log monitors writing to a temporary run directory.

    .venv/bin/python benchmarks/overhead.py [--rounds 12] [--steps 8] [RECIPE] [k=v ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from trainbook.commands.preflight import prepare_data
from trainbook.commands.recipe import default_recipe
from trainbook.commands.resolve import resolve
from trainbook.data import TrainLoader
from trainbook.model import build_model
from trainbook.train.trainer import Trainer


def bare_loop(model, optimizer, batches, lrs: list[float], *, accum: int, grad_clip: float) -> float:
    """What a person would write by hand: no timing, no reports, no logging. Returns the last loss."""
    for lr in lrs:
        for group in optimizer.param_groups:
            group["lr"] = lr
        for _ in range(accum):
            inputs, targets = next(batches)[:2]
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=None)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per timed block")
    args = parser.parse_args()

    recipe = Path(args.recipe) if args.recipe else default_recipe()
    overrides = [*args.overrides, "log.progress=plain", "log.every_steps=1000000", "train.eval_every=0"]
    res = resolve(recipe, overrides, world_size=1)
    cfg = res.cfg
    data = prepare_data(res, log=lambda _: None)
    device = torch.device("cpu")
    t = cfg.train

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, Path(run_dir), data, device)
        tb_batches = iter(trainer.train_loader)

        # The bare loop gets its own copy of the same model, optimizer and data order.
        model = build_model(cfg.model, device, seed=cfg.run.seed)
        # Written out by hand, nanoGPT-style: decay matrices, not norms or the embedding.
        embedding = model.tok_embeddings.weight
        decay = [p for p in model.parameters() if p.ndim >= 2 and p is not embedding]
        no_decay = [p for p in model.parameters() if p.ndim < 2 or p is embedding]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.optim.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
        )
        bare_batches = iter(TrainLoader(data.train, {s.name: s.weight for s in cfg.data.sources},
                                        t.seq_len, t.micro_batch_size, seed=cfg.run.seed))

        # Both sides follow the same LR schedule: the speed of CPU kernels depends a little on
        # the values they see, so the two models must stay identical for a fair comparison.
        losses = {"trainbook": [], "bare": []}
        bare_step = 0

        def run_trainbook() -> None:
            for _ in range(args.steps):
                losses["trainbook"].append(trainer.advance(tb_batches).loss)

        def run_bare() -> None:
            nonlocal bare_step
            lrs = [trainer.schedule(bare_step + i) for i in range(args.steps)]
            bare_step += args.steps
            losses["bare"].append(bare_loop(model, optimizer, bare_batches, lrs, accum=t.grad_accum_steps(),
                                            grad_clip=cfg.optim.grad_clip))

        run_trainbook(), run_bare()  # warm-up: allocator, thread pools, first-call costs
        tokens = args.steps * trainer.tokens_per_step
        ratios, tb_rates, bare_rates, totals = [], [], [], {"trainbook": 0.0, "bare": 0.0}
        for i in range(args.rounds):
            # Alternate which side goes first so drift in machine load does not favour one.
            order = (("trainbook", run_trainbook), ("bare", run_bare))
            times = {}
            for name, fn in order if i % 2 == 0 else reversed(order):
                start = time.perf_counter()
                fn()
                times[name] = time.perf_counter() - start
                totals[name] += times[name]
            tb_rates.append(tokens / times["trainbook"])
            bare_rates.append(tokens / times["bare"])
            ratios.append(times["bare"] / times["trainbook"])
            print(f"round {i + 1}: trainbook {tb_rates[-1]:,.0f} tok/s  bare {bare_rates[-1]:,.0f} tok/s  "
                  f"ratio {ratios[-1]:.3f}", flush=True)
        trainer.close()

    same = losses["trainbook"][args.steps - 1 :: args.steps] == losses["bare"]
    print(f"both sides computed the same losses (bitwise): {same}")
    print(f"model {cfg.model.name}, {t.grad_accum_steps()} x {t.micro_batch_size} x {t.seq_len} tokens/step, "
          f"{args.rounds} rounds x {args.steps} steps, torch threads {torch.get_num_threads()}")
    print(f"trainbook {statistics.median(tb_rates):,.0f} tok/s, bare {statistics.median(bare_rates):,.0f} tok/s")
    # The fastest block of each side is the one least disturbed by other load on the machine.
    print(f"ratio (trainbook / bare tokens/s): median of rounds {statistics.median(ratios):.3f}, "
          f"all rounds {totals['bare'] / totals['trainbook']:.3f}, "
          f"fastest blocks {max(tb_rates) / max(bare_rates):.3f}  (goal >= 0.97)")


if __name__ == "__main__":
    main()
