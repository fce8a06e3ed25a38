"""Loader throughput from shards, per worker setting, against the default recipe's training.

Reads the default recipe's prepared shards through the training loader alone (no model) with
0 (in-process), 1 and 2 worker processes, and compares with the tokens/s its training consumes
(the newest run's metrics.jsonl, or a short training probe), in one run.

    .venv/bin/python benchmarks/loader.py [--seconds 5] [RECIPE] [k=v ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trainbook.commands.bench import loader_rate, training_rate
from trainbook.commands.preflight import prepare_data
from trainbook.commands.recipe import default_recipe
from trainbook.commands.resolve import resolve
from trainbook.parallel import pick_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=None)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()

    recipe = Path(args.recipe) if args.recipe else default_recipe()
    res = resolve(recipe, args.overrides, world_size=1)
    cfg = res.cfg
    data = prepare_data(res, log=lambda _: None)
    train_tps, source = training_rate(cfg, data, pick_device(cfg.run.device))
    print(f"training consumes {train_tps:,.0f} tokens/s (from {source})")
    for workers in (0, 1, 2):
        probe = cfg.model_copy(update={"data": cfg.data.model_copy(update={"num_workers": workers})})
        samples, tokens = loader_rate(probe, data, args.seconds)
        per_worker = tokens / max(workers, 1)
        print(f"num_workers={workers}: {samples:,.0f} samples/s, {tokens:,.0f} tokens/s "
              f"({per_worker:,.0f} per {'worker' if workers else 'process'}; goal >= 5,000,000), "
              f"{tokens / train_tps:,.0f}x training (goal >= 50x)", flush=True)


if __name__ == "__main__":
    main()
