"""Baselines: what a recipe's run shows, measured over several seeds, and a run judged against it.

A baseline (`recipes/baselines/<recipe>.json`) holds, for every logged step of the recipe, the
training loss (and at every evaluation the validation loss) of each of `seeds` runs, summed up as
a band: mean +- k sample standard deviations, never narrower than `floor` x |mean|. It also holds
the exact series of the first seed (the recipe's own), tokens/s and peak memory, the resolved
config, and the environment the runs were measured in.

Judging a run: where its environment (`environment`) is the baseline's, the same config and seed
must give the same numbers bit for bit, so every point is compared exactly with the first seed's
series (the gradient norm too); anywhere else each point must fall within its band. Speed and
memory depend on the machine and its load: they are reported, never judged.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from trainbook.errors import TrainbookError
from trainbook.monitor.archive import RunRecord

FORMAT = 1
BANDED = ("loss", "val_loss")
"""Judged within the band anywhere, exactly where the environment matches."""
EXACT_ONLY = ("grad_norm",)
"""Judged only where the environment matches (exactly)."""
ENV_KEYS = ("python", "torch", "torch_threads", "cuda", "device", "devices", "world_size", "parallel")


def environment(env: dict) -> dict:
    """What must be equal for two runs of one config and seed to agree bit for bit: the
    interpreter, torch (build, threads), the devices, world size and layout, and the version of
    every package recorded. Not trainbook's own version: a change to trainbook that changes the
    numbers is what a baseline is there to catch."""
    out = {k: env.get(k) for k in ENV_KEYS}
    out["packages"] = {k: v for k, v in sorted((env.get("packages") or {}).items()) if k != "trainbook"}
    return out


def environment_differences(here: dict, baseline: dict) -> list[str]:
    """`key: this run's value vs the baseline's` for each difference of two `environment`s."""
    out = []
    for key in sorted(set(here) | set(baseline)):
        a, b = here.get(key), baseline.get(key)
        if key == "packages":
            a, b = a or {}, b or {}
            out += [f"{name} {a.get(name, 'absent')} (baseline {b.get(name, 'absent')})"
                    for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
        elif a != b:
            out.append(f"{key} {a} (baseline {b})")
    return out


def series(run: RunRecord) -> dict[str, dict[int, float]]:
    """metric -> step -> value, for the metrics a baseline keeps."""
    def numbers(records: list[dict], key: str) -> dict[int, float]:
        return {r["step"]: r[key] for r in records if isinstance(r.get(key), (int, float))}

    out = {m: numbers(run.train, m) for m in ("loss", *EXACT_ONLY)}
    out["val_loss"] = numbers(run.evals, "val_loss")
    return out


def speed(run: RunRecord) -> tuple[float | None, int | None]:
    """The median tokens/s of a run's logged steps after the first (which pays the warm-up), and
    its peak memory in bytes."""
    rates = [r["tokens_per_s"] for r in run.train[1:] if isinstance(r.get("tokens_per_s"), (int, float))]
    peaks = [r["mem_peak_bytes"] for r in run.train if isinstance(r.get("mem_peak_bytes"), int)]
    return (statistics.median(rates) if rates else None), (max(peaks) if peaks else None)


def make_baseline(runs: list[RunRecord], seeds: list[int], k: float, floor: float, recipe: str,
                  command: str, config: dict) -> dict:
    """The baseline of `runs` (one per seed, the recipe's own seed first)."""
    if len(runs) < 2:
        raise TrainbookError(f"a band needs at least 2 seeds, got {len(runs)}", where="--seeds")
    all_series = [series(r) for r in runs]
    points = {}
    for metric in BANDED:
        steps = sorted(set.intersection(*(set(s[metric]) for s in all_series)))
        points[metric] = [_point(step, [s[metric][step] for s in all_series], k, floor) for step in steps]
    first = all_series[0]
    rates, peaks = zip(*(speed(r) for r in runs))
    return {
        "format": FORMAT,
        "recipe": recipe,
        "command": command,
        "seeds": seeds,
        "k": k,
        "floor": floor,
        "steps": max(runs[0].steps, 0),
        "tokens": runs[0].train[-1].get("tokens") if runs[0].train else None,
        "environment": environment(runs[0].env),
        "trainbook": (runs[0].env.get("packages") or {}).get("trainbook"),
        "config": config,
        "points": points,
        "seed0": {metric: [[step, value] for step, value in sorted(first[metric].items())] for metric in first},
        "tokens_per_s": _summary([r for r in rates if r is not None]),
        "mem_peak_bytes": _summary([p for p in peaks if p is not None]),
    }


def _point(step: int, values: list[float], k: float, floor: float) -> dict:
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = max(k * sd, floor * abs(mean))
    return {"step": step, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half, "values": values}


def _summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def check_baseline(data: object, where: str) -> dict:
    """A baseline file's contents, checked enough that judging cannot trip on them."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TrainbookError(f"not a trainbook baseline (format {FORMAT})", where=where)
    for key in ("seeds", "k", "points", "seed0", "environment", "config"):
        if key not in data:
            raise TrainbookError(f"missing key {key!r}", where=where)
    for metric, points in data["points"].items():
        for i, p in enumerate(points):
            if not all(isinstance(p.get(x), (int, float)) for x in ("step", "mean", "lo", "hi")):
                raise TrainbookError("a point needs numbers step, mean, lo, hi", where=f"{where}: points.{metric}[{i}]")
    return data


@dataclass(frozen=True)
class PointCheck:
    step: int
    metric: str
    value: float | None
    """This run's value; None: the run did not log this point."""
    expected: float | None
    """The first seed's value (the recipe's own seed)."""
    lo: float | None
    hi: float | None
    sd: float | None
    exact: bool
    """Judged bit for bit (the environment matches), else within the band."""

    @property
    def in_band(self) -> bool:
        return self.value is not None and self.lo is not None and self.lo <= self.value <= self.hi

    @property
    def ok(self) -> bool:
        if self.value is None:
            return False
        return self.value == self.expected if self.exact else self.in_band

    def why(self) -> str:
        if self.value is None:
            return "not logged by this run"
        if self.exact and self.value != self.expected:
            off = f"not bit-for-bit equal ({self.value - self.expected:+.3g})"
            if self.lo is None:  # judged exactly only (the gradient norm): no band to place it in
                return off
            return f"{off}, {'but within the band' if self.in_band else 'and out of band'}"
        if self.sd:
            return f"out of band ({(self.value - (self.lo + self.hi) / 2) / self.sd:+.1f} sd from the mean)"
        return "out of band"


def judge(run: RunRecord, baseline: dict, exact: bool, last_step: int) -> list[PointCheck]:
    """Every baseline point up to `last_step`, checked against `run`."""
    have = series(run)
    seed0 = {m: {int(s): v for s, v in pairs} for m, pairs in baseline["seed0"].items()}
    checks = []
    for metric in BANDED:
        for p in baseline["points"].get(metric, []):
            if p["step"] <= last_step:
                checks.append(PointCheck(p["step"], metric, have[metric].get(p["step"]), seed0.get(metric, {}).get(p["step"]),
                                         p["lo"], p["hi"], p.get("sd"), exact))
    if exact:
        for metric in EXACT_ONLY:
            for step, value in sorted(seed0.get(metric, {}).items()):
                if step <= last_step:
                    checks.append(PointCheck(step, metric, have[metric].get(step), value, None, None, None, True))
    return sorted(checks, key=lambda c: (c.step, c.metric))


def speed_line(run: RunRecord, baseline: dict) -> str:
    """Tokens/s and peak memory of the run beside the baseline's (not judged)."""
    rate, peak = speed(run)
    parts = []
    base = baseline.get("tokens_per_s")
    if rate is not None and base:
        parts.append(f"{rate:,.0f} tokens/s (baseline {base['mean']:,.0f} +- {base['sd']:,.0f})")
    base = baseline.get("mem_peak_bytes")
    if peak is not None and base:
        parts.append(f"peak memory {peak / 2**20:,.0f} MiB (baseline {base['mean'] / 2**20:,.0f} MiB)")
    return "speed and memory (not judged: they depend on the machine and its load): " + "; ".join(parts) if parts else ""


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return "nan" if math.isnan(v) else f"{v:.6g}"
