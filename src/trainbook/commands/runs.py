"""`trainbook runs`: the run archive as a table, filtered by resolved-config keys, sorted.

Status comes from each run's own files (monitor/archive.py says how it is decided).
"""

from __future__ import annotations

import datetime as dt
import tomllib
from pathlib import Path

from trainbook.config import parse_override
from trainbook.errors import TrainbookError
from trainbook.monitor.archive import RunRecord, find_runs, load_run
from trainbook.monitor.compare import fmt_value, format_table

# --sort: what to sort by, and whether the best comes first by being the largest.
SORT_KEYS = {"name": False, "start": False, "status": False, "steps": True, "loss": False, "val_loss": False,
             "tokens_per_s": True}


def runs_command(root: Path, where: list[str], sort: str | None) -> str:
    """The table `trainbook runs` prints. Every argument is checked before any run is read."""
    filters = [parse_where(item) for item in where]
    if sort is not None and sort not in SORT_KEYS:
        raise TrainbookError(f"unknown metric {sort!r}; one of: {', '.join(SORT_KEYS)}", where=f"--sort {sort}")
    if not root.is_dir():
        raise TrainbookError("no such directory", where=f"--root {root}")
    runs = [load_run(p, need_metrics=False) for p in find_runs(root)]
    runs = [r for r in runs if all(matches(r, key, value) for key, value in filters)]
    if sort is not None:
        runs = sort_runs(runs, sort)
    if not runs:
        return f"no runs under {root}" + (" match " + " ".join(where) if where else "")
    rows = [[r.name, str(r.path.relative_to(root)), _start(r), r.status, _steps(r), fmt_value(r.final_loss),
             fmt_value(r.final_val_loss), fmt_value(r.tokens_per_s), _short(r.status_detail)] for r in runs]
    header = ["name", "run", "start", "status", "steps", "loss", "val loss", "tokens/s", "detail"]
    return format_table(header, rows)


def parse_where(item: str) -> tuple[str, object]:
    """`optim.lr=0.004` -> ("optim.lr", 0.004): the key must exist in the config schema, the value
    is parsed as a command-line override is (to the field's type, TOML syntax)."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip() or not text.strip():
        raise TrainbookError(f"{item!r} is not of the form key.path=value", where="--where")
    try:
        return parse_override(item)
    except TrainbookError as e:
        raise TrainbookError(e.message, where=f"--where {key.strip()}") from None


def matches(run: RunRecord, key: str, value: object) -> bool:
    actual = run.config_value(key)
    if actual == value:
        return True
    if isinstance(value, str):  # a field that takes text or numbers (micro_batch_size = auto | 4)
        try:
            return actual == tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            return False
    return False


def sort_runs(runs: list[RunRecord], key: str) -> list[RunRecord]:
    """Best first for metrics (lowest loss, most tokens/s, most steps); runs without a value last."""
    def value(run: RunRecord):
        return {"name": run.name, "start": run.started, "status": run.status, "steps": run.steps,
                "loss": run.final_loss, "val_loss": run.final_val_loss, "tokens_per_s": run.tokens_per_s}[key]

    known = [r for r in runs if value(r) is not None]
    missing = [r for r in runs if value(r) is None]
    return sorted(known, key=value, reverse=SORT_KEYS[key]) + missing


def _start(run: RunRecord) -> str:
    t = run.started
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if isinstance(t, (int, float)) else "-"


def _steps(run: RunRecord) -> str:
    return f"{run.steps}/{run.max_steps}" if run.max_steps else str(run.steps)


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
