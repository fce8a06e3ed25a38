"""`trainbook sweep RECIPE optim.lr=1e-4,3e-4,1e-3 train.global_batch_tokens=2048,4096 [--parallel N]`

The grid of the comma-separated overrides (every combination, in the order given; an override
without a comma applies to every point), each point a real `trainbook run` in a child process,
N at a time, archived under one sweep directory:

    <runs_root>/<name>/sweep-<time>/
      sweep.json          the grid and every point's status, exit code, error, final numbers
      01-lr=0.0001/ ...   each point's run directory
      logs/01.out ...     each point's terminal output
      compare.html        the finished points side by side (`trainbook compare`)

A point that fails (its config is invalid, or its run stops with an error) is recorded with its
one-line error and the sweep goes on; the exit code is 1 when any point failed, 2 when none could
start (the grid itself is bad input).
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import re
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from trainbook.atomic import atomic_write_json
from trainbook.commands.compare import compare_command
from trainbook.commands.recipe import last_error, recipe_and_overrides, run_argv
from trainbook.config import load_config
from trainbook.errors import TrainbookError
from trainbook.monitor.archive import is_run_dir, load_run
from trainbook.monitor.baseline import speed
from trainbook.monitor.compare import fmt_value, format_table

POLL_S = 0.2


@dataclass
class Point:
    index: int
    overrides: list[str]
    """The grid's values for this point (the fixed overrides are the sweep's)."""
    run_dir: str
    status: str = "pending"
    """pending | running | done | failed | invalid"""
    exit_code: int | None = None
    error: str = ""
    seconds: float | None = None
    steps: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    tokens_per_s: float | None = None
    output: str = ""

    @property
    def label(self) -> str:
        return ", ".join(self.overrides) or "(the recipe)"


@dataclass
class Sweep:
    recipe: str
    fixed: list[str]
    axes: dict[str, list[str]]
    points: list[Point] = field(default_factory=list)


def split_grid(overrides: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Overrides with a comma outside brackets and quotes are axes of the grid; the rest are fixed."""
    fixed, axes = [], {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise TrainbookError("expected key.path=value or key.path=a,b,c", where=item)
        values = _top_level_split(value)
        if len(values) > 1:
            if key in axes:
                raise TrainbookError("this key is swept twice", where=key)
            if any(not v.strip() for v in values):
                raise TrainbookError(f"an empty value in {value!r}", where=key)
            axes[key] = values
        else:
            fixed.append(item)
    if not axes:
        raise TrainbookError("no axis to sweep: give at least one key.path=a,b,c", where="command line")
    return fixed, axes


def _top_level_split(value: str) -> list[str]:
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(value):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(value[start:i])
            start = i + 1
    return parts + [value[start:]]


def sweep_command(recipe: str | None, overrides: list[str] | None, parallel: int, out: Path | None,
                  log: Callable[[str], None] = print) -> tuple[str, int]:
    """What `trainbook sweep` prints, and its exit code."""
    if parallel < 1:
        raise TrainbookError(f"must be at least 1, got {parallel}", where="--parallel")
    path, overrides = recipe_and_overrides(recipe, overrides)
    fixed, axes = split_grid(overrides)
    cfg = _first_valid(path, fixed, axes)
    name = cfg.run.name or path.stem
    folder = Path(out) if out is not None else Path(cfg.run.runs_root) / name / f"sweep-{dt.datetime.now():%Y%m%d-%H%M%S}"
    if folder.exists() and any(folder.iterdir()):
        raise TrainbookError("directory is not empty; a sweep is never written over another", where=f"--out {folder}")
    if parallel > 1 and cfg.run.device in ("auto", "cpu") and not any(o.startswith("run.threads=") for o in fixed):
        threads = max(1, (os.cpu_count() or 1) // parallel)
        fixed = [*fixed, f"run.threads={threads}"]
        log(f"sweep: {parallel} runs at a time share this machine's cores: run.threads={threads} each")
    sweep = Sweep(str(path), fixed, axes)
    keys = list(axes)
    for i, values in enumerate(itertools.product(*(axes[k] for k in keys)), start=1):
        point_overrides = [f"{k}={v}" for k, v in zip(keys, values)]
        slug = "-".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in zip(keys, values))
        run_dir = folder / f"{i:02d}-{re.sub(r'[^A-Za-z0-9_.=+-]', '_', slug)[:80]}"
        point = Point(i, point_overrides, str(run_dir), output=str(folder / "logs" / f"{i:02d}.out"))
        try:
            load_config(path, fixed + point_overrides)
        except TrainbookError as e:
            point.status, point.exit_code, point.error = "invalid", e.exit_code, str(e)
        sweep.points.append(point)
    folder.mkdir(parents=True, exist_ok=True)
    log(f"sweep {name}: {len(sweep.points)} points ({' x '.join(f'{len(v)} {k}' for k, v in axes.items())}), "
        f"{parallel} at a time -> {folder}")
    _run_points(sweep, folder, parallel, log)
    return _summary(sweep, folder), 1 if any(p.status != "done" for p in sweep.points) else 0


def _first_valid(path: Path, fixed: list[str], axes: dict[str, list[str]]):
    """The config of the first valid point; every point invalid is bad input (the first error)."""
    first_error = None
    for values in itertools.product(*axes.values()):
        try:
            return load_config(path, fixed + [f"{k}={v}" for k, v in zip(axes, values)])
        except TrainbookError as e:
            first_error = first_error or e
    raise first_error


def _run_points(sweep: Sweep, folder: Path, parallel: int, log: Callable[[str], None]) -> None:
    todo = [p for p in sweep.points if p.status == "pending"]
    for p in sweep.points:
        if p.status == "invalid":
            log(f"  point {p.index:02d} {p.label}: invalid: {p.error}")
    running: dict[int, tuple[Point, subprocess.Popen, float]] = {}
    _save(sweep, folder)
    try:
        while todo or running:
            while todo and len(running) < parallel:
                point = todo.pop(0)
                running[point.index] = (point, _start(sweep, point), time.monotonic())
                point.status = "running"
                log(f"  point {point.index:02d} {point.label}: started -> {point.run_dir}")
                _save(sweep, folder)
            time.sleep(POLL_S)
            for index, (point, proc, started) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[index]
                _finish(point, proc.returncode, time.monotonic() - started)
                log(f"  point {point.index:02d} {point.label}: {_outcome(point)}")
                _save(sweep, folder)
    finally:
        for point, proc, _ in running.values():  # interrupted: the children stop with a checkpoint
            proc.wait()
            _finish(point, proc.returncode, None)
        _save(sweep, folder)


def _start(sweep: Sweep, point: Point) -> subprocess.Popen:
    Path(point.output).parent.mkdir(parents=True, exist_ok=True)
    cmd = run_argv(sweep.recipe, [*sweep.fixed, *point.overrides], point.run_dir)
    with open(point.output, "wb") as out:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)


def _finish(point: Point, code: int, seconds: float | None) -> None:
    point.exit_code, point.seconds = code, seconds
    if is_run_dir(Path(point.run_dir)):
        run = load_run(Path(point.run_dir), need_metrics=False)
        point.steps, point.loss, point.val_loss = run.steps, run.final_loss, run.final_val_loss
        point.tokens_per_s = speed(run)[0]
    if code == 0:
        point.status = "done"
    else:
        point.status, point.error = "failed", last_error(Path(point.output))


def _outcome(point: Point) -> str:
    if point.status == "done":
        val = f", val_loss {point.val_loss:.4f}" if point.val_loss is not None else ""
        return f"done in {point.seconds:,.0f} s: {point.steps} steps, loss {point.loss:.4f}{val}"
    return f"failed (exit {point.exit_code}): {point.error}"


def _save(sweep: Sweep, folder: Path) -> None:
    atomic_write_json(folder / "sweep.json", {
        "recipe": sweep.recipe, "fixed": sweep.fixed, "axes": sweep.axes,
        "points": [asdict(p) | {"label": p.label} for p in sweep.points],
    })


def _summary(sweep: Sweep, folder: Path) -> str:
    done = sorted((p for p in sweep.points if p.status == "done"),
                  key=lambda p: (p.val_loss is None, p.val_loss if p.val_loss is not None else 0.0))
    failed = [p for p in sweep.points if p.status != "done"]
    lines = [f"sweep {folder}: {len(done)} of {len(sweep.points)} points done" + (f", {len(failed)} failed" if failed else "")]
    if done:
        rows = [[str(p.index), *p.overrides, fmt_value(p.val_loss), fmt_value(p.loss), str(p.steps),
                 fmt_value(p.tokens_per_s), Path(p.run_dir).name] for p in done]
        lines += ["", "by final val loss (best first):",
                  format_table(["#", *sweep.axes, "val_loss", "loss", "steps", "tokens/s", "run"], rows)]
    if failed:
        lines += ["", "failed:"] + [f"  {p.index:02d} {p.label}: {p.status} (exit {p.exit_code}): {p.error}" for p in failed]
    if len(done) >= 2:
        text = compare_command([Path(p.run_dir) for p in done], folder / "compare.html")
        lines += ["", text]
    lines.append(f"\nthe grid and every point: {folder / 'sweep.json'}")
    return "\n".join(lines)
