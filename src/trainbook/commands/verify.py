"""`trainbook verify RECIPE|RUN [--steps N] [--baseline FILE]`: is this what the recipe promises?

A recipe is run first (a real `trainbook run` in a child process; `--steps N` ends it after step N
with its schedule unchanged); a run directory is read as it is. Then every point of the baseline
up to that step is judged (monitor/baseline.py): bit for bit when the environment and the config
are the baseline's, within the band otherwise. Exit 0 when every point passes, 1 when one does not
(or the run failed), 2 on bad input.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainbook.commands.recipe import baseline_path, default_recipe, recipe_and_overrides, run_in_subprocess
from trainbook.config import dotted_keys, load_config, with_defaults
from trainbook.errors import TrainbookError
from trainbook.model.families import config_as_built
from trainbook.monitor.archive import RunRecord, is_run_dir, load_run
from trainbook.monitor.baseline import (
    PointCheck, check_baseline, environment, environment_differences, fmt, judge, speed_line,
)
from trainbook.monitor.compare import format_table
from trainbook.runs import new_run_dir_path

NUMERICALLY_INERT = ("run.name", "run.runs_root", "train.stop_at_step", "log.", "checkpoint.", "alerts.",
                     "monitor.", "data.cache_dir", "env.", "launch.", "expect")
"""Config keys that change what is written or watched, not the numbers: ignored when deciding
whether a run can be judged bit for bit."""
MAX_ROWS = 20


def verify_command(target: str | None, overrides: list[str] | None, steps: int | None,
                   baseline_file: Path | None) -> tuple[str, int]:
    """What `trainbook verify` prints, and its exit code."""
    if steps is not None and steps < 1:
        raise TrainbookError(f"must be at least 1, got {steps}", where="--steps")
    if target is not None and Path(target).is_dir():
        if overrides:
            raise TrainbookError("overrides apply to a recipe, not to a finished run", where=" ".join(overrides))
        run = load_run(Path(target))
        baseline_file = Path(baseline_file) if baseline_file else _run_baseline(run.name)
        baseline = read_baseline(baseline_file, hint=True)
        head = [f"verify {run.path} against {baseline_file}"]
    else:
        path, overrides = recipe_and_overrides(target, overrides)
        extra = [f"train.stop_at_step={steps}"] if steps is not None else []
        cfg = load_config(path, overrides + extra)  # bad input stops here, before anything runs
        name = cfg.run.name or path.stem
        baseline_file = Path(baseline_file) if baseline_file else baseline_path(path, name)
        baseline = read_baseline(baseline_file, hint=True)
        run_dir = new_run_dir_path(cfg.run.runs_root, name)
        code = run_in_subprocess(path, overrides + extra, run_dir)
        if code != 0 or not is_run_dir(run_dir):
            return f"verify: the run failed (exit {code}); nothing to judge ({run_dir})", 2 if code == 2 else 1
        run = load_run(run_dir)
        head = [f"verify {path}{' ' + ' '.join(overrides) if overrides else ''} against {baseline_file}"]
    return judged_text(head, run, baseline, steps)


def _run_baseline(name: str) -> Path:
    """A run's baseline by its name: ./recipes/baselines/, else the packaged recipes' own."""
    local = Path("recipes") / "baselines" / f"{name}.json"
    packaged = baseline_path(default_recipe(), name)
    return local if local.is_file() or not packaged.is_file() else packaged


def read_baseline(path: Path, hint: bool = False) -> dict:
    """A baseline file, or a one-line error naming it."""
    if not path.is_file():
        fix = "; make one with `trainbook baseline RECIPE --seeds 5`, or name one with --baseline FILE" if hint else ""
        raise TrainbookError(f"no such baseline file{fix}", where=str(path))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise TrainbookError(f"not valid JSON: {e}", where=str(path)) from None
    return check_baseline(data, str(path))


def judged_text(head: list[str], run: RunRecord, baseline: dict, steps: int | None) -> tuple[str, int]:
    """The verdict on `run`: the mode and why, the points out of band, speed beside it."""
    last_step = min(steps or run.steps, run.steps)
    env_diff = environment_differences(environment(run.env), baseline["environment"])
    config_diff = config_differences(run, baseline["config"])
    exact = not env_diff and not config_diff
    seeds, k = baseline["seeds"], baseline["k"]
    lines = [*head, f"run: {run.path} ({last_step} of {run.max_steps} steps)"]
    band = f"the band of {len(seeds)} seeds (mean +- {k:g} sd)"
    if exact:
        lines.append(f"environment and config: the baseline's -> judged bit for bit against seed {seeds[0]}'s run")
    else:
        if env_diff:
            lines.append(f"environment differs from the baseline's: {', '.join(env_diff)}")
        if config_diff:
            lines.append(f"config differs from the baseline's: {', '.join(config_diff)}")
        lines.append(f"-> judged within {band}")
    checks = judge(run, baseline, exact, last_step)
    bad = [c for c in checks if not c.ok]
    if not checks:
        lines.append(f"FAIL: no baseline point at or before step {last_step} to judge")
        return "\n".join(lines), 1
    speed = speed_line(run, baseline)
    if not bad:
        how = "bit-for-bit equal to the baseline's" if exact else "within the band"
        lines.append(f"PASS: {len(checks)} points up to step {last_step}, all {how}")
        return "\n".join(lines + ([speed] if speed else [])), 0
    first = bad[0]
    lines.append(f"FAIL: {len(bad)} of {len(checks)} points up to step {last_step} fail; the first at step "
                 f"{first.step} ({first.metric}: {first.why()})")
    lines.append(_table(bad[:MAX_ROWS], seeds[0]))
    if len(bad) > MAX_ROWS:
        lines.append(f"... and {len(bad) - MAX_ROWS} more")
    return "\n".join(lines + ([speed] if speed else [])), 1


def config_differences(run: RunRecord, baseline_config: dict) -> list[str]:
    """`key value (baseline value)` for each key that can change the numbers. Keys added since the
    baseline was written are compared with their defaults (`with_defaults`)."""
    here, there = dotted_keys(run.config), dotted_keys(config_as_built(with_defaults(baseline_config)))
    out = []
    for key in sorted(set(here) | set(there)):
        if key.startswith(NUMERICALLY_INERT) or here.get(key) == there.get(key):
            continue
        out.append(f"{key} = {here.get(key, 'unset')} (baseline {there.get(key, 'unset')})")
    return out


def _table(checks: list[PointCheck], seed: int) -> str:
    rows = [[str(c.step), c.metric, fmt(c.value), fmt(c.expected), f"{fmt(c.lo)} .. {fmt(c.hi)}" if c.lo is not None else "-",
             c.why()] for c in checks]
    return format_table(["step", "metric", "this run", f"seed {seed}", "band", "why"], rows)
