"""What reading memory at every phase change costs a training step (diagnose/phase_memory.py).

One Trainer on the default recipe (or `k=v` overrides) runs its real steps (`Trainer.advance`),
every other step with the phase-memory listener attached (as every run has it), the others
without; the step times of each side are compared by their medians. Also printed: the cost of
one memory read and the phase changes per step, so the figure can be judged for other models.

    .venv/bin/python benchmarks/phase_memory.py [--rounds 6] [--steps 20] [k=v ...]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import torch

from trainbook.commands.preflight import prepare_data
from trainbook.commands.recipe import default_recipe
from trainbook.commands.resolve import resolve
from trainbook.parallel.device import MemoryGauge
from trainbook.runs import create_run_dir
from trainbook.train.build import one_process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the default recipe")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20, help="steps per round and side")
    args = parser.parse_args()
    total = args.rounds * args.steps * 2 + 1
    res = resolve(default_recipe(), [*args.overrides, f"train.max_steps={total}", "train.eval_every=0",
                                     "monitor.tensorboard=false"], world_size=1)
    data = prepare_data(res, log=lambda *a: None)
    gauge = MemoryGauge(torch.device("cpu"))
    read_us = timeit.timeit(gauge, number=20000) / 20000 * 1e6
    gauge.close()
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "console", "w") as out, \
            contextlib.redirect_stdout(out):
        run_dir = Path(tmp) / "run"
        create_run_dir(run_dir.parent, "bench", run_dir)
        trainer = one_process(res.cfg, run_dir, data, torch.device("cpu"))
        listeners = list(trainer.tracker._listeners)
        changes = []
        trainer.tracker.listen(lambda left, entered: changes.append(1))
        trainer.advance()  # warm-up, and count the phase changes of one step
        per_step = len(changes)
        trainer.tracker._listeners[:] = listeners
        times: dict[bool, list[float]] = {True: [], False: []}
        # Step by step, alternating (this machine is shared: slow spells hit both sides alike).
        for i in range(args.rounds * args.steps * 2):
            on = i % 2 == 0
            trainer.tracker._listeners[:] = listeners if on else []
            start = time.perf_counter()
            trainer.advance()
            times[on].append(time.perf_counter() - start)
        trainer.close()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"memory read: {read_us:.1f} us; {per_step} phase changes per step "
          f"(~{per_step * read_us:.0f} us of reads per step)")
    print(f"median step: {off * 1e3:.2f} ms without, {on * 1e3:.2f} ms with phase memory; "
          f"ratio with/without {on / off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
