"""`trainbook baseline RECIPE --seeds 5`: run a recipe once per seed and write its baseline.

The seeds are the recipe's own and the next ones (`run.seed`, `run.seed + 1`, ...); each run is a
real `trainbook run` in a child process, archived under `<runs_root>/<name>/baseline-<time>/`.
The file (`recipes/baselines/<name>.json` by default) is written only when every seed finished.
"""

from __future__ import annotations

import datetime as dt
import shlex
import sys
import time
from pathlib import Path
from typing import Callable

from trainbook.atomic import atomic_write_json
from trainbook.commands.recipe import baseline_path, last_error, recipe_and_overrides, run_in_subprocess
from trainbook.config import load_config, scrub, secret_values
from trainbook.errors import TrainbookError
from trainbook.monitor.archive import load_run
from trainbook.monitor.baseline import make_baseline


def baseline_command(recipe: str | None, overrides: list[str] | None, seeds: int, k: float, floor: float,
                     steps: int | None, out: Path | None, log: Callable[[str], None] = print) -> tuple[str, int]:
    """What `trainbook baseline` prints, and its exit code (1: a seed's run failed)."""
    path, overrides = recipe_and_overrides(recipe, overrides)
    if seeds < 2:
        raise TrainbookError(f"a band needs at least 2 seeds, got {seeds}", where="--seeds")
    extra = [f"train.stop_at_step={steps}"] if steps is not None else []
    cfg = load_config(path, overrides + extra)  # bad input stops here, before anything runs
    name = cfg.run.name or path.stem
    out = Path(out) if out is not None else baseline_path(path, name)
    folder = Path(cfg.run.runs_root) / name / f"baseline-{dt.datetime.now():%Y%m%d-%H%M%S}"
    seed_list = [cfg.run.seed + i for i in range(seeds)]
    runs = []
    for i, seed in enumerate(seed_list, start=1):
        run_dir = folder / f"seed-{seed}"
        log(f"baseline {name}: seed {seed} ({i} of {seeds}) -> {run_dir}")
        started = time.monotonic()
        output = folder / f"seed-{seed}.out"
        code = run_in_subprocess(path, [*overrides, *extra, f"run.seed={seed}"], run_dir, output)
        if code != 0:
            return (f"baseline {name}: seed {seed}'s run failed (exit {code}): {last_error(output)}; "
                    f"nothing written to {out}; its output is in {output}"), 1
        run = load_run(run_dir)
        runs.append(run)
        log(f"  done in {time.monotonic() - started:,.0f} s: {run.steps} steps, loss {run.final_loss:.4f}"
            + (f", val_loss {run.final_val_loss:.4f}" if run.final_val_loss is not None else ""))
    command = shlex.join(["trainbook", "baseline", *sys.argv[2:]]) if sys.argv[1:2] == ["baseline"] else ""
    command = scrub(command, secret_values(cfg.model_dump(mode="json")))  # a secret only as its fingerprint
    data = make_baseline(runs, seed_list, k, floor, str(path), command, runs[0].config)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, data)
    return summary(data, out), 0


def summary(data: dict, out: Path) -> str:
    """Steps, tokens, the final validation loss and how wide its band is."""
    lines = [f"baseline written: {out} ({len(data['seeds'])} seeds {data['seeds']}, band mean +- {data['k']:g} sd)"]
    lines.append(f"  {data['steps']} steps, {data['tokens'] or 0:,} tokens per run")
    for metric in ("loss", "val_loss"):
        points = data["points"].get(metric) or []
        if points:
            p = points[-1]
            lines.append(f"  final {metric} at step {p['step']}: {p['mean']:.4f} +- {p['sd']:.4f} sd, "
                         f"band {p['lo']:.4f} .. {p['hi']:.4f} (width {p['hi'] - p['lo']:.4f})")
    rate = data.get("tokens_per_s")
    if rate:
        lines.append(f"  {rate['mean']:,.0f} +- {rate['sd']:,.0f} tokens/s")
    return "\n".join(lines)
