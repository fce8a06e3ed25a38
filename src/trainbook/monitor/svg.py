"""Charts as inline SVG text: line charts (two y axes, event markers), stacked areas, heatmaps.

Everything is computed here in Python, so a page needs no script, library or font to draw: it
opens offline and looks the same everywhere. Each chart is `<svg class="chart" data-series=N>`
and each drawn series a `<path class="series" data-points=K>`: tests (and readers) count them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

# Distinct colours (Tableau 10), in the order series are given.
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#bcbd22", "#7f7f7f")
EVENT_COLOURS = {"checkpoint": "#2ca02c", "resume": "#1f77b4", "alert": "#d62728", "skipped_step": "#ff7f0e",
                 "stopped": "#9467bd", "end": "#7f7f7f", "reepoch": "#17becf", "checkpoint_invalid": "#8c564b"}

WIDTH, HEIGHT = 640, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 64, 28, 44  # margins: axis labels and ticks live there


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]
    colour: str = ""
    dashed: bool = False
    right: bool = False
    """Drawn against the right-hand axis (e.g. MFU beside tokens/s)."""
    dots: bool = False
    """A square at each point, no line between them (events on a timeline)."""


@dataclass
class Marker:
    """An event at a step: a vertical line with its description as a tooltip."""

    x: float
    kind: str
    text: str


@dataclass
class Chart:
    chart_id: str
    title: str
    x_label: str
    y_label: str
    series: list[Series]
    markers: list[Marker] = field(default_factory=list)
    y2_label: str = ""
    note: str = ""
    """Shown under the title (e.g. why a series is missing)."""
    y_names: dict[float, str] = field(default_factory=dict)
    """Named rows instead of numeric y ticks (an event timeline: one row per kind)."""
    x_extent: tuple[float, float] | None = None
    """The x range to show at least (a timeline spans the whole run, not only its events)."""


def colour_series(series: list[Series]) -> list[Series]:
    for i, s in enumerate(series):
        s.colour = s.colour or PALETTE[i % len(PALETTE)]
    return series


def line_chart(chart: Chart) -> str:
    """Lines over a shared x axis; series with `right=True` use a second y axis."""
    drawn = [s for s in colour_series(chart.series) if _finite(s.points)]
    for s in drawn:
        s.points = _finite(s.points)
    left = [s for s in drawn if not s.right]
    right = [s for s in drawn if s.right]
    xs = [x for s in drawn for x, _ in s.points] + [m.x for m in chart.markers] + list(chart.x_extent or ())
    x_scale = _Scale(xs, LEFT, WIDTH - RIGHT)
    y_left = _Scale([y for s in left for _, y in s.points] + [y + d for y in chart.y_names for d in (-0.5, 0.5)],
                    HEIGHT - BOTTOM, TOP)
    if chart.y_names:
        y_left.ticks = sorted(chart.y_names)
    y_right = _Scale([y for s in right for _, y in s.points], HEIGHT - BOTTOM, TOP)
    body = [_frame(chart, x_scale, y_left, y_right if right else None)]
    for m in chart.markers:
        x = x_scale(m.x)
        body.append(f'<line class="event event-{escape(m.kind)}" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" '
                    f'y2="{HEIGHT - BOTTOM}" stroke="{EVENT_COLOURS.get(m.kind, "#555")}" stroke-width="1.5" '
                    f'stroke-dasharray="3 3"><title>{escape(m.text)}</title></line>')
    for s in drawn:
        y_scale = y_right if s.right else y_left
        points = [(x_scale(x), y_scale(y)) for x, y in s.points]
        if s.dots:
            d = "".join(f"M{x - 4:.1f},{y - 4:.1f} h8 v8 h-8 Z" for x, y in points)
            body.append(f'<path class="series" data-name="{escape(s.name)}" data-points="{len(points)}" d="{d}" '
                        f'fill="{s.colour}"><title>{escape(s.name)}</title></path>')
            continue
        d = "M" + " L".join(f"{x:.1f},{y:.1f}" for x, y in points)
        if len(points) == 1:  # one point has no line: a short tick through it, and a dot (below)
            d = f"M{points[0][0] - 4:.1f},{points[0][1]:.1f} h8"
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        body.append(f'<path class="series" data-name="{escape(s.name)}" data-points="{len(points)}" d="{d}" '
                    f'fill="none" stroke="{s.colour}" stroke-width="2"{dash}><title>{escape(s.name)}</title></path>')
        if len(points) == 1:
            body.append(f'<circle cx="{points[0][0]:.1f}" cy="{points[0][1]:.1f}" r="3" fill="{s.colour}"/>')
    return _svg(chart, len(drawn), body, drawn)


def stacked_chart(chart: Chart) -> str:
    """Areas stacked bottom-up in the order given (all series share the x values of the first)."""
    drawn = [s for s in colour_series(chart.series) if _finite(s.points)]
    xs = [x for x, _ in drawn[0].points] if drawn else []
    totals = [sum(dict(s.points).get(x, 0.0) for s in drawn) for x in xs]
    x_scale = _Scale(xs + [m.x for m in chart.markers], LEFT, WIDTH - RIGHT)
    y_scale = _Scale(totals + [0.0], HEIGHT - BOTTOM, TOP)
    body = [_frame(chart, x_scale, y_scale, None)]
    below = [0.0] * len(xs)
    for s in drawn:
        values = dict(s.points)
        above = [b + values.get(x, 0.0) for b, x in zip(below, xs)]
        top = [(x_scale(x), y_scale(y)) for x, y in zip(xs, above)]
        bottom = [(x_scale(x), y_scale(y)) for x, y in zip(xs, below)][::-1]
        d = "M" + " L".join(f"{x:.1f},{y:.1f}" for x, y in top + bottom) + " Z"
        body.append(f'<path class="series" data-name="{escape(s.name)}" data-points="{len(xs)}" d="{d}" '
                    f'fill="{s.colour}" fill-opacity="0.75" stroke="{s.colour}"><title>{escape(s.name)}</title></path>')
        below = above
    return _svg(chart, len(drawn), body, drawn)


def heatmap(chart_id: str, title: str, rows: list[str], columns: list[float],
            values: list[list[float | None]], value_label: str) -> str:
    """rows x columns cells; colour by log10 of the value (statistics span decades), grey when missing."""
    logs = [math.log10(v) for row in values for v in row if v is not None and v > 0 and math.isfinite(v)]
    lo, hi = (min(logs), max(logs)) if logs else (0.0, 1.0)
    height = TOP + BOTTOM + 16 * len(rows)
    left = 86
    cell_w = (WIDTH - left - RIGHT) / max(len(columns), 1)
    body = [f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" class="title">{escape(title)}</text>']
    for r, name in enumerate(rows):
        y = TOP + 16 * r
        body.append(f'<text x="{left - 6}" y="{y + 12}" text-anchor="end" class="tick">{escape(name)}</text>')
        for c, step in enumerate(columns):
            v = values[r][c]
            fill = "#dddddd" if v is None or not v > 0 or not math.isfinite(v) else _ramp(
                (math.log10(v) - lo) / (hi - lo) if hi > lo else 0.5)
            shown = "missing" if v is None else f"{v:.4g}"
            body.append(f'<rect class="cell" x="{left + c * cell_w:.1f}" y="{y}" width="{cell_w:.1f}" height="16" '
                        f'fill="{fill}"><title>{escape(name)} step {step:g}: {shown}</title></rect>')
    y_axis = TOP + 16 * len(rows)
    for c in _tick_indices(len(columns)):
        x = left + (c + 0.5) * cell_w
        body.append(f'<text x="{x:.1f}" y="{y_axis + 14}" text-anchor="middle" class="tick">{columns[c]:g}</text>')
    body.append(f'<text x="{(left + WIDTH - RIGHT) / 2}" y="{height - 8}" text-anchor="middle" class="label">'
                f'step (colour: log10 {escape(value_label)}, {lo:.2f} to {hi:.2f})</text>')
    return (f'<svg class="chart heatmap" id="{escape(chart_id)}" data-series="{len(rows)}" '
            f'data-cells="{len(rows) * len(columns)}" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" '
            f'height="{height}" role="img" aria-label="{escape(title)}">{"".join(body)}</svg>')


def _ramp(t: float) -> str:
    """Dark blue (low) to yellow (high), a perceptually ordered ramp."""
    stops = ((0.0, (48, 18, 59)), (0.35, (40, 120, 200)), (0.7, (70, 200, 120)), (1.0, (250, 230, 60)))
    t = min(max(t, 0.0), 1.0)
    for (t0, c0), (t1, c1) in zip(stops, stops[1:]):
        if t <= t1:
            f = (t - t0) / (t1 - t0)
            return "#" + "".join(f"{round(a + (b - a) * f):02x}" for a, b in zip(c0, c1))
    return "#fae63c"


def _tick_indices(n: int, most: int = 8) -> list[int]:
    stride = max(1, math.ceil(n / most))
    return list(range(0, n, stride))


# ---- frame and scales -----------------------------------------------------------------------


class _Scale:
    """Data range -> pixel range, widened to round ticks."""

    def __init__(self, values: list[float], start: float, end: float):
        lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
        if hi == lo:
            pad = abs(lo) * 0.05 or 1.0
            lo, hi = lo - pad, hi + pad
        self.ticks = _nice_ticks(lo, hi)
        self.lo, self.hi = min(lo, self.ticks[0]), max(hi, self.ticks[-1])
        self.start, self.end = start, end

    def __call__(self, v: float) -> float:
        return self.start + (v - self.lo) / (self.hi - self.lo) * (self.end - self.start)


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    t = first
    while t < hi + step * 0.999:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _fmt(v: float) -> str:
    a = abs(v)
    if a >= 1e9:
        return f"{v / 1e9:g}G"
    if a >= 1e6:
        return f"{v / 1e6:g}M"
    if a >= 1e4:
        return f"{v / 1e3:g}k"
    return f"{v:.4g}"


def _frame(chart: Chart, x: _Scale, y: _Scale, y2: _Scale | None) -> str:
    parts = [f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" class="title">{escape(chart.title)}</text>',
             f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}" '
             f'fill="none" stroke="#999"/>']
    for t in x.ticks:
        px = x(t)
        if LEFT - 0.5 <= px <= WIDTH - RIGHT + 0.5:
            parts.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{HEIGHT - BOTTOM}" y2="{HEIGHT - BOTTOM + 4}" stroke="#999"/>'
                         f'<text x="{px:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle" class="tick">{_fmt(t)}</text>')
    for t in y.ticks:
        py = y(t)
        if TOP - 0.5 <= py <= HEIGHT - BOTTOM + 0.5:
            name = chart.y_names.get(t, _fmt(t))
            parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py:.1f}" y2="{py:.1f}" stroke="#eee"/>'
                         f'<text x="{LEFT - 6}" y="{py + 4:.1f}" text-anchor="end" class="tick">{escape(name)}</text>')
    if y2 is not None:
        for t in y2.ticks:
            py = y2(t)
            if TOP - 0.5 <= py <= HEIGHT - BOTTOM + 0.5:
                parts.append(f'<text x="{WIDTH - RIGHT + 6}" y="{py + 4:.1f}" class="tick">{_fmt(t)}</text>')
        parts.append(f'<text class="label" transform="translate({WIDTH - 12},{(TOP + HEIGHT - BOTTOM) / 2}) '
                     f'rotate(90)" text-anchor="middle">{escape(chart.y2_label)}</text>')
    parts.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" text-anchor="middle" class="label">'
                 f'{escape(chart.x_label)}</text>')
    parts.append(f'<text class="label" transform="translate(14,{(TOP + HEIGHT - BOTTOM) / 2}) rotate(-90)" '
                 f'text-anchor="middle">{escape(chart.y_label)}</text>')
    return "".join(parts)


def _svg(chart: Chart, n_series: int, body: list[str], drawn: list[Series]) -> str:
    legend = "".join(
        f'<span class="key"><span class="swatch" style="background:{s.colour}"></span>{escape(s.name)}</span>'
        for s in drawn)
    kinds = sorted({m.kind for m in chart.markers} - {s.name for s in drawn})
    legend += "".join(
        f'<span class="key"><span class="swatch event-swatch" style="border-color:{EVENT_COLOURS.get(k, "#555")}">'
        f'</span>{escape(k)}</span>' for k in kinds)
    note = f'<div class="note">{escape(chart.note)}</div>' if chart.note else ""
    empty = '<div class="note">no data</div>' if not n_series else ""
    return (f'<figure class="panel"><svg class="chart" id="{escape(chart.chart_id)}" data-series="{n_series}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
            f'aria-label="{escape(chart.title)}">{"".join(body)}</svg>'
            f'<figcaption class="legend">{legend}</figcaption>{note}{empty}</figure>')


def _finite(points: list[tuple[float, float | None]]) -> list[tuple[float, float]]:
    return [(x, y) for x, y in points
            if isinstance(y, (int, float)) and isinstance(x, (int, float)) and math.isfinite(y) and math.isfinite(x)]
