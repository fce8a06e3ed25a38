"""The run report and the comparison page: one self-contained HTML file each.

Everything is inline (styles, SVG charts drawn by monitor/svg.py); the page loads nothing, runs
no script and uses the reader's system fonts, so it opens offline, from an archive, years later.
"""

from __future__ import annotations

import datetime as dt
from html import escape

from trainbook.monitor.archive import RunRecord
from trainbook.monitor.compare import (
    METRICS, config_differences, describe_verdict, fmt_value, run_labels, verdicts,
)
from trainbook.monitor.svg import EVENT_COLOURS, PALETTE, Chart, Marker, Series, heatmap, line_chart, stacked_chart

PHASES = ("data", "forward", "backward", "grad_sync", "optimizer", "checkpoint", "eval")
# Events drawn on every chart's timeline (alerts, skips, restarts, saves).
MARKED_EVENTS = ("checkpoint", "resume", "alert", "skipped_step", "stopped", "checkpoint_invalid")
LAYER_STATS = (("grad_norm", "gradient norm"), ("update_ratio", "update / weight ratio"),
               ("act_std", "activation std"), ("act_max_abs", "activation max |x|"))
HIGHLIGHTS = ("model.name", "model.dim", "model.n_layers", "model.n_heads", "model.vocab_size", "train.max_steps",
              "train.seq_len", "train.micro_batch_size", "train.global_batch_tokens", "optim.lr",
              "optim.weight_decay", "optim.grad_clip", "schedule.kind", "schedule.warmup_steps",
              "precision.dtype", "parallel.dp_replicate", "parallel.dp_shard", "parallel.tp", "parallel.pp",
              "run.seed")

STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#555;margin-bottom:12px}.status{padding:2px 8px;border-radius:10px;color:#fff;font-weight:600}
.status-finished{background:#2ca02c}.status-running{background:#1f77b4}.status-stopped{background:#9467bd}
.status-failed,.status-died{background:#d62728}.status-unknown{background:#7f7f7f}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.grid{display:flex;flex-wrap:wrap;gap:16px}.panel{margin:0;border:1px solid #eee;padding:6px}
.chart .title{font-size:14px;font-weight:600}.chart .tick{font-size:11px;fill:#444}
.chart .label{font-size:12px;fill:#222}.legend{font-size:12px;max-width:640px}
.key{margin-right:12px;white-space:nowrap}.swatch{display:inline-block;width:14px;height:4px;margin:0 4px 3px 0;vertical-align:middle}
.event-swatch{height:10px;width:0;border-left:2px dashed}.note{font-size:12px;color:#8a5a00;margin-top:4px}
.cols{display:flex;gap:32px;flex-wrap:wrap}
"""


def report_page(run: RunRecord) -> str:
    """The report of one run: header, charts over steps with the run's events, layers, events."""
    markers = _markers(run)
    steps = [r["step"] for r in run.train]
    charts = [
        line_chart(Chart("chart-loss", "Loss", "step", "loss", [
            Series("train loss", _points(run.train, "loss")),
            Series("val loss", _points(run.evals, "val_loss"), dashed=True)], markers)),
        line_chart(Chart("chart-lr", "Learning rate", "step", "lr", [Series("lr", _points(run.train, "lr"))], markers)),
        line_chart(Chart("chart-grad-norm", "Gradient norm (before clipping)", "step", "grad norm",
                         [Series("grad norm", _points(run.train, "grad_norm"))], markers)),
        _throughput_chart(run, markers),
        _phases_chart(run, markers),
        _memory_chart(run, markers),
    ]
    charts += _objective_charts(run, markers)
    if any(isinstance(r.get("loss_scale"), (int, float)) for r in run.train):
        charts.append(line_chart(Chart("chart-loss-scale", "fp16 loss scale", "step", "scale",
                                       [Series("loss scale", _points(run.train, "loss_scale"))], markers)))
    body = [
        _header(run, steps),
        '<h2>Training curves</h2><div class="grid">', *charts, "</div>",
        "<h2>Per-layer statistics</h2>", _layers(run),
        *(["<h2>Expert load</h2>", _expert_load(run)] if run.experts else []),
        "<h2>Events</h2>", _events_timeline(run), _events_table(run),
    ]
    return _page(f"trainbook report: {run.name}", body)


def _objective_charts(run: RunRecord, markers: list[Marker]) -> list[str]:
    """Post-training's figures (train/grpo.py, train/dpo.py), where the records hold them: GRPO's
    reward (and each function's), KL, entropy and completion length; DPO's implicit rewards and
    the share of pairs ranked right."""
    train = run.train

    def has(key: str) -> bool:
        return any(_number(r.get(key)) is not None for r in train)

    def chart(cid: str, title: str, axis: str, keys: list[tuple[str, str]]) -> str:
        return line_chart(Chart(cid, title, "step", axis, [Series(label, _points(train, key), dashed=i > 0)
                                                            for i, (key, label) in enumerate(keys)], markers))

    out = []
    if has("reward"):
        functions = sorted({k for r in train for k in r if k.startswith("rewards/") and k.endswith("/mean")})
        out.append(chart("chart-reward", "Reward (mean over a step's completions)", "reward",
                         [("reward", "reward"), *((k, k.split("/")[1]) for k in functions)]))
        for key, cid, title, axis in (("kl", "chart-kl", "KL to the reference (a completion token)", "kl"),
                                      ("entropy", "chart-entropy", "Entropy (nats a completion token)", "entropy"),
                                      ("completions/mean_length", "chart-completion-length",
                                       "Completion length (tokens)", "tokens")):
            if has(key):
                out.append(chart(cid, title, axis, [(key, axis)]))
    if has("rewards/margins"):
        out.append(chart("chart-preference", "Implicit rewards beta (policy - reference)", "reward",
                         [("rewards/margins", "margin"), ("rewards/chosen", "chosen"), ("rewards/rejected", "rejected")]))
        out.append(chart("chart-accuracy", "Pairs ranked right", "share", [("rewards/accuracies", "accuracy")]))
    return out


def _phases_chart(run: RunRecord, markers: list[Marker]) -> str:
    """The step's phases stacked; a phase that took no time in any record (no checkpoint or
    evaluation fell on a logged step) is left out rather than drawn as an empty band."""
    def seconds(r: dict, phase: str) -> float | None:
        value = (r.get("phases") or {}).get(phase)
        return value if isinstance(value, (int, float)) else None

    series = [Series(p, [(r["step"], seconds(r, p)) for r in run.train if seconds(r, p) is not None])
              for p in PHASES if any(seconds(r, p) for r in run.train)]
    return stacked_chart(Chart("chart-phases", "Step time by phase", "step", "seconds", series, markers))


def compare_page(runs: list[RunRecord]) -> str:
    """Runs side by side: config differences, who is ahead, every curve overlaid (one colour per run)."""
    labels = run_labels(runs)
    overlaid = []
    for chart_id, title, source, key, y_label in (
        ("chart-loss", "Training loss", "train", "loss", "loss"),
        ("chart-val-loss", "Validation loss", "eval", "val_loss", "val loss"),
        ("chart-lr", "Learning rate", "train", "lr", "lr"),
        ("chart-grad-norm", "Gradient norm", "train", "grad_norm", "grad norm"),
        ("chart-tokens-per-s", "Throughput", "train", "tokens_per_s", "tokens/s"),
        ("chart-memory", "Peak memory", "train", "mem_peak_bytes", "bytes"),
    ):
        series = [Series(label, _points(run.train if source == "train" else run.evals, key), PALETTE[i % len(PALETTE)])
                  for i, (label, run) in enumerate(zip(labels, runs))]
        overlaid.append(line_chart(Chart(chart_id, title, "step", y_label, series)))
    per_step = [r.tokens_per_step for r in runs]
    if len({round(t) for t in per_step if t}) > 1:
        series = [Series(label, [(r["step"] * t, r["loss"]) for r in run.train if isinstance(r.get("loss"), (int, float))],
                         PALETTE[i % len(PALETTE)]) for i, (label, run, t) in enumerate(zip(labels, runs, per_step)) if t]
        overlaid.append(line_chart(Chart("chart-loss-tokens", "Training loss at equal tokens", "tokens", "loss",
                                         series)))
    run_rows = "".join(
        f'<tr><td><span class="swatch" style="background:{PALETTE[i % len(PALETTE)]}"></span>{escape(label)}</td>'
        f"<td>{escape(str(run.path))}</td><td>{_status(run)}</td><td class=num>{run.steps}</td>"
        f"<td class=num>{fmt_value(run.final_loss)}</td><td class=num>{fmt_value(run.final_val_loss)}</td></tr>"
        for i, (label, run) in enumerate(zip(labels, runs)))
    body = [
        f"<h1>trainbook compare: {len(runs)} runs</h1>",
        "<table><tr><th>run</th><th>directory</th><th>status</th><th>steps</th><th>final loss</th>"
        f"<th>final val loss</th></tr>{run_rows}</table>",
        "<h2>Config differences</h2>", _diff_table(runs, labels),
        "<h2>Who is ahead</h2>", _verdict_table(runs, labels),
        '<h2>Curves</h2><div class="grid">', *overlaid, "</div>",
    ]
    return _page("trainbook compare: " + ", ".join(labels), body)


# ---- the report's parts ---------------------------------------------------------------------


def _header(run: RunRecord, steps: list[int]) -> str:
    started = _time(run.started)
    of = f"/{run.max_steps}" if run.max_steps else ""
    tokens = run.train[-1].get("tokens") if run.train else None
    facts = [("status", _status(run) + (f" {escape(run.status_detail)}" if run.status_detail else "")),
             ("steps", f"{run.steps}{of}"), ("tokens", fmt_value(tokens)), ("started", escape(started)),
             ("final loss", fmt_value(run.final_loss)), ("final val loss", fmt_value(run.final_val_loss)),
             ("median tokens/s", fmt_value(run.tokens_per_s)), ("checkpoints", escape(", ".join(run.checkpoints) or "-"))]
    config = [(k, run.config_value(k)) for k in HIGHLIGHTS if run.config_value(k) is not None]
    env = run.env
    git = env.get("git") or {}
    env_rows = [("host", env.get("host")), ("device", env.get("device")), ("devices", ", ".join(env.get("devices") or [])),
                ("world size", env.get("world_size")), ("python", env.get("python")), ("torch", env.get("torch")),
                ("cuda", env.get("cuda")), ("trainbook", (env.get("packages") or {}).get("trainbook")),
                ("git", f"{git.get('commit', '')[:12]}{' (dirty)' if git.get('dirty') else ''}" if git else None),
                ("command", " ".join(env.get("command") or []))]
    return (f"<h1>{escape(run.name)}</h1><div class=sub>{escape(str(run.path))}</div>"
            '<div class="cols">'
            + _kv_table("Run", facts, raw=True)
            + _kv_table("Config highlights", [(k, fmt_value(v)) for k, v in config])
            + _kv_table("Environment", [(k, fmt_value(v)) for k, v in env_rows if v not in (None, "")])
            + "</div>")


def _kv_table(title: str, rows: list[tuple[str, str]], raw: bool = False) -> str:
    cells = "".join(f"<tr><th>{escape(k)}</th><td>{v if raw else escape(str(v))}</td></tr>" for k, v in rows)
    return f"<div><h2>{escape(title)}</h2><table>{cells}</table></div>"


def _status(run: RunRecord) -> str:
    return f'<span class="status status-{escape(run.status)}">{escape(run.status)}</span>'


def _throughput_chart(run: RunRecord, markers: list[Marker]) -> str:
    series = [Series("tokens/s", _points(run.train, "tokens_per_s"))]
    mfu = _points(run.train, "mfu")
    note = "" if mfu else "MFU not recorded (the device's peak FLOP/s is unknown, or the run predates MFU)"
    if mfu:
        series.append(Series("MFU", mfu, right=True))
    return line_chart(Chart("chart-throughput", "Throughput and MFU", "step", "tokens/s", series, markers,
                            y2_label="MFU" if mfu else "", note=note))


def _memory_chart(run: RunRecord, markers: list[Marker]) -> str:
    series = [Series("peak memory (rank 0)", _points(run.train, "mem_peak_bytes"))]
    for end in ("max", "min"):
        points = [(r["step"], r["ranks"]["mem_peak_bytes"][end]) for r in run.train
                  if isinstance(r.get("ranks"), dict) and isinstance(r["ranks"].get("mem_peak_bytes"), dict)
                  and isinstance(r["ranks"]["mem_peak_bytes"].get(end), (int, float))]
        if points:
            series.append(Series(f"peak memory ({end} over ranks)", points, dashed=True))
    return line_chart(Chart("chart-memory", "Peak memory", "step", "bytes", series, markers))


def _layers(run: RunRecord) -> str:
    if not run.layers:
        return ('<div class="note" id="no-layer-stats">No layer statistics: this run has no layers.jsonl '
                "(monitor.layer_stats_every = 0, or the run predates per-layer statistics).</div>")
    blocks: list[str] = []
    for record in run.layers:
        for name in record.get("blocks") or {}:
            if name not in blocks:
                blocks.append(name)
    steps = [r["step"] for r in run.layers]
    maps = []
    for key, label in LAYER_STATS:
        values = [[_number(((r.get("blocks") or {}).get(b) or {}).get(key)) for r in run.layers] for b in blocks]
        if any(v is not None for row in values for v in row):
            maps.append(heatmap(f"heatmap-{key.replace('_', '-')}", f"Per-layer {label}", blocks, steps, values, label))
    return '<div class="grid">' + "".join(maps) + "</div>" if maps else (
        '<div class="note" id="no-layer-stats">No layer statistics: layers.jsonl holds no values.</div>')


def _expert_load(run: RunRecord) -> str:
    """A mixture of experts: per MoE layer, each expert's tokens over the logged steps as a share
    of the layer's mean (1: even; grey: no token, a dead expert), from experts.jsonl."""
    layers: list[str] = []
    for record in run.experts:
        layers += [name for name in record.get("layers") or {} if name not in layers]
    steps = [r["step"] for r in run.experts]
    maps = []
    for layer in layers:
        rows = [((r.get("layers") or {}).get(layer) or {}).get("tokens") for r in run.experts]
        width = max((len(t) for t in rows if isinstance(t, list)), default=0)
        shares = [[None] * width if not isinstance(t, list) or not sum(t) else [v * len(t) / sum(t) for v in t]
                  for t in rows]
        values = [[shares[c][e] for c in range(len(steps))] for e in range(width)]
        maps.append(heatmap(f"heatmap-experts-{layer.replace('.', '-')}", f"{layer}: tokens per expert / mean",
                            [f"expert {e}" for e in range(width)], steps, values, "tokens / mean"))
    return '<div class="grid">' + "".join(maps) + "</div>"


def _events_timeline(run: RunRecord) -> str:
    """Every event on one row per kind over the run's steps; hover a mark for its details."""
    events = [e for e in run.events if isinstance(e.get("step"), int) and isinstance(e.get("kind"), str)]
    kinds = sorted({e["kind"] for e in events})
    rows = {k: float(len(kinds) - i) for i, k in enumerate(kinds)}  # first kind on top
    series = [Series(k, [(e["step"], rows[k]) for e in events if e["kind"] == k],
                     EVENT_COLOURS.get(k, PALETTE[i % len(PALETTE)]), dots=True) for i, k in enumerate(kinds)]
    markers = [Marker(e["step"], e["kind"], _describe(e)) for e in events if e["kind"] in MARKED_EVENTS]
    return line_chart(Chart("chart-events", "Events", "step", "event", series, markers,
                            y_names={row: k for k, row in rows.items()}, x_extent=(0, max(run.steps, 1))))


def _events_table(run: RunRecord) -> str:
    rows = "".join(f"<tr><td class=num>{e.get('step', '')}</td><td>{escape(str(e.get('kind', '')))}</td>"
                   f"<td>{escape(_time(e.get('time')))}</td><td>{escape(_describe(e))}</td></tr>" for e in run.events)
    return f'<table id="events"><tr><th>step</th><th>event</th><th>time</th><th>details</th></tr>{rows}</table>'


def _describe(event: dict) -> str:
    details = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("kind", "step", "time"))
    return f"{event.get('kind')} at step {event.get('step')}" + (f": {details}" if details else "")


def _markers(run: RunRecord) -> list[Marker]:
    return [Marker(e["step"], e["kind"], _describe(e)) for e in run.events
            if e.get("kind") in MARKED_EVENTS and isinstance(e.get("step"), int)]


# ---- the comparison's tables ----------------------------------------------------------------


def _diff_table(runs: list[RunRecord], labels: list[str]) -> str:
    diffs = config_differences(runs)
    if not diffs:
        return '<div class="note">The resolved configs are identical.</div>'
    head = "".join(f"<th>{escape(x)}</th>" for x in labels)
    rows = "".join(f"<tr><td>{escape(k)}</td>" + "".join(f"<td>{escape(fmt_value(v))}</td>" for v in vs) + "</tr>"
                   for k, vs in diffs.items())
    return f'<table id="config-diff"><tr><th>key</th>{head}</tr>{rows}</table>'


def _verdict_table(runs: list[RunRecord], labels: list[str]) -> str:
    found = verdicts(runs)
    if not found:
        return '<div class="note">Fewer than two runs have metrics to compare.</div>'
    head = "".join(f"<th>{escape(x)}</th>" for x in labels)
    rows = "".join(
        f"<tr><td>{escape(METRICS[v.metric][0])}</td><td>{escape(v.basis)}</td>"
        + "".join(f"<td class=num>{escape(fmt_value(x))}</td>" for x in v.values)
        + f"<td>{escape(describe_verdict(v, labels))}</td></tr>" for v in found)
    return f'<table id="verdicts"><tr><th>metric</th><th>at</th>{head}<th>ahead</th></tr>{rows}</table>'


# ---- helpers ----------------------------------------------------------------------------------


def _page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
            + "".join(body) + "</body></html>\n")


def _points(records: list[dict], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in records if _number(r.get(key)) is not None]


def _number(v) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _time(t) -> str:
    if not isinstance(t, (int, float)):
        return "-"
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")
