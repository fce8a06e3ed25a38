"""Runs side by side: the config keys that differ, and per metric which run is ahead, by how much.

"Ahead" is judged where the runs can be compared fairly: at the last step every run reached
(equal steps) and, when the runs train on different numbers of tokens per step, also at the
largest token count every run reached (equal tokens, each curve interpolated linearly there).
Curves (loss, val loss, grad norm) are compared at that point; rates (tokens/s, step time,
memory) by their median over the steps every run logged.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from trainbook.config import dotted_keys
from trainbook.monitor.archive import RunRecord

# metric -> (label, source, lower is better, kind): curves compare at a point, rates by median.
METRICS = {
    "loss": ("loss", "train", True, "curve"),
    "val_loss": ("val loss", "eval", True, "curve"),
    "tokens_per_s": ("tokens/s", "train", False, "rate"),
    "step_time_s": ("step time (s)", "train", True, "rate"),
    "mfu": ("MFU", "train", False, "rate"),
    "mem_peak_bytes": ("peak memory (bytes)", "train", True, "rate"),
}


@dataclass(frozen=True)
class Verdict:
    metric: str
    basis: str
    """"step 40" or "1.02M tokens": where the runs were compared."""
    values: list[float | None]
    """One per run, in the order given."""
    ahead: int | None
    """Index of the run ahead; None when fewer than two runs have a value or they tie."""
    by: float
    """Absolute gap between the best and the runner-up."""
    by_relative: float
    """The gap relative to the runner-up's value."""


def run_labels(runs: list[RunRecord]) -> list[str]:
    """Short, distinct names: the run directory's name, with its parent when names repeat."""
    names = [r.path.name for r in runs]
    if len(set(names)) < len(names):
        names = [f"{r.path.parent.name}/{r.path.name}" for r in runs]
    if len(set(names)) < len(names):
        names = [f"{i + 1}:{n}" for i, n in enumerate(names)]
    return names


def config_differences(runs: list[RunRecord]) -> dict[str, list]:
    """Dotted key -> one value per run (None where a run lacks the key), for keys that differ.
    `run.name` and `run.runs_root` only say where a run went: they are left out."""
    flats = [dotted_keys(r.config) for r in runs]
    keys = sorted(set().union(*flats) - {"run.runs_root"})
    return {k: [f.get(k) for f in flats] for k in keys if len({repr(f.get(k)) for f in flats}) > 1}


def verdicts(runs: list[RunRecord]) -> list[Verdict]:
    """For each metric some run logged: who is ahead at equal steps, then at equal tokens when
    the runs' tokens per step differ."""
    out = []
    per_step = [r.tokens_per_step for r in runs]
    tokens_differ = len({round(t) for t in per_step if t}) > 1
    for metric, (_, source, lower, kind) in METRICS.items():
        series = [_series(r, metric, source) for r in runs]
        if sum(1 for s in series if s) < 2:
            continue
        out.append(_judge(metric, series, lower, kind, "step"))
        if tokens_differ and kind == "curve" and all(per_step):
            by_tokens = [[(x * t, y) for x, y in s] for s, t in zip(series, per_step)]
            out.append(_judge(metric, by_tokens, lower, kind, "tokens"))
    return out


def _series(run: RunRecord, metric: str, source: str) -> list[tuple[float, float]]:
    records = run.train if source == "train" else run.evals
    return [(r["step"], r[metric]) for r in records if isinstance(r.get(metric), (int, float))]


def _judge(metric: str, series: list[list[tuple[float, float]]], lower: bool, kind: str, axis: str) -> Verdict:
    present = [s for s in series if s]
    if kind == "curve":
        at = min(s[-1][0] for s in present)  # the furthest point every run reached
        values = [_interpolate(s, at) if s else None for s in series]
        basis = f"step {at:g}" if axis == "step" else f"{_count(at)} tokens"
    else:
        common = set.intersection(*(set(x for x, _ in s) for s in present))
        values = [statistics.median([y for x, y in s if x in common]) if s and common else None for s in series]
        basis = f"median over {len(common)} common steps"
    return _ahead(metric, basis, values, lower)


def _ahead(metric: str, basis: str, values: list[float | None], lower: bool) -> Verdict:
    known = sorted((v, i) for i, v in enumerate(values) if v is not None)
    if len(known) < 2:
        return Verdict(metric, basis, values, None, 0.0, 0.0)
    if not lower:
        known.reverse()
    (best, index), (second, _) = known[0], known[1]
    gap = abs(best - second)
    if gap == 0:
        return Verdict(metric, basis, values, None, 0.0, 0.0)
    return Verdict(metric, basis, values, index, gap, gap / abs(second) if second else float("inf"))


def _interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """y at x, linear between the logged points around it (None beyond the curve's ends)."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if points and points[0][0] == x:
        return points[0][1]
    return None


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


# ---- the terminal ---------------------------------------------------------------------------


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _numeric(cell: str) -> bool:
    return cell.replace(".", "", 1).replace("-", "", 1).replace("e", "", 1).replace("%", "").strip().isdigit()


def fmt_value(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def describe_verdict(v: Verdict, labels: list[str]) -> str:
    if v.ahead is None:
        return "tie" if sum(x is not None for x in v.values) >= 2 else "-"
    return f"{labels[v.ahead]} by {fmt_value(v.by)} ({v.by_relative:.1%})"


def compare_text(runs: list[RunRecord], labels: list[str], html_path: str) -> str:
    """What `trainbook compare` prints: runs, config differences, verdicts, the curves side by side."""
    parts = ["runs:"] + [f"  {label}: {run.path} ({run.status}, {run.steps} steps)" for label, run in zip(labels, runs)]
    diffs = config_differences(runs)
    parts.append("")
    if diffs:
        parts.append(format_table(["config key", *labels], [[k, *(fmt_value(v) for v in vs)] for k, vs in diffs.items()]))
    else:
        parts.append("config: no differences")
    found = verdicts(runs)
    if found:
        parts.append("")
        rows = [[METRICS[v.metric][0], v.basis, *(fmt_value(x) for x in v.values), describe_verdict(v, labels)]
                for v in found]
        parts.append(format_table(["metric", "at", *labels, "ahead"], rows))
    parts.append("")
    parts.append(_curves_table(runs, labels))
    parts.append("")
    parts.append(f"html: {html_path}")
    return "\n".join(parts)


def _curves_table(runs: list[RunRecord], labels: list[str]) -> str:
    """Loss and val loss of every run at each logged step (at most 25 rows: evenly spaced)."""
    loss = [{r["step"]: r.get("loss") for r in run.train} for run in runs]
    val = [{r["step"]: r.get("val_loss") for r in run.evals} for run in runs]
    steps = sorted(set().union(*loss, *val))
    if len(steps) > 25:
        stride = len(steps) / 25
        steps = sorted({steps[int(i * stride)] for i in range(25)} | {steps[-1]})
    header = ["step", *(f"loss {x}" for x in labels), *(f"val {x}" for x in labels)]
    rows = [[str(s), *(fmt_value(m.get(s)) for m in loss), *(fmt_value(m.get(s)) for m in val)] for s in steps]
    return format_table(header, rows)
