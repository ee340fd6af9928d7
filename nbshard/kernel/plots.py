"""Charts of a run: each rank's memory over time and each ``log_metrics`` series per rank.

Drawn as self-contained SVG by this module: no plotting library, no script, nothing fetched,
so a chart renders wherever HTML does (JupyterLab, a saved notebook, a browser) and the
kernel stays torch-free. ``handle.plot()`` returns a ``Plot``; the live view draws the same
charts, smaller, as the job runs.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nbshard.kernel.telemetry import shown_bytes, shown_cpu_bytes

__all__ = ["Chart", "Plot", "charts_html", "charts_of"]

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
MAX_POINTS = 400  # per series: more would not show on a chart this wide, and would cost each redraw
_NOT_METRICS = ("rank", "time", "step")
_FONT = 'font-family="sans-serif" font-size="11" fill="#444"'


@dataclasses.dataclass
class Chart:
    """One chart: a series of (x, y) points per rank."""

    title: str
    x_label: str
    series: dict[int, list[tuple[float, float]]]
    bytes: bool = False  # y holds bytes: drawn in one unit (KiB, MiB, GiB) for the whole axis
    since_start: bool = False  # x is seconds since the run started: the axis begins there, at 0

    def svg(self, width: int = 380, height: int = 200) -> str:
        return _chart_svg(self, width, height)


class Plot:
    """Charts of one run, shown in a notebook as they are (``_repr_html_``); ``save(path)``
    writes them as a standalone HTML file."""

    def __init__(self, charts: list[Chart], title: str = "") -> None:
        self.charts = charts
        self.title = title

    def __repr__(self) -> str:
        names = ", ".join(chart.title for chart in self.charts) or "nothing yet"
        return f"<Plot of {self.title or 'a run'}: {names}>"

    def _repr_html_(self) -> str:
        heading = f'<div style="font-weight:bold;margin:2px 0">{html.escape(self.title)}</div>' if self.title else ""
        body = charts_html(self.charts) or "<i>no memory samples or metrics yet</i>"
        return f'<div class="nbshard-plot">{heading}{body}</div>'

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(f'<!doctype html><meta charset="utf-8"><title>{html.escape(self.title)}</title>{self._repr_html_()}\n')
        return path


def charts_of(memory: Sequence[dict[str, Any]], metrics: Sequence[dict[str, Any]], started: float) -> list[Chart]:
    """The charts of a run's memory records and metrics records (``handle.memory()`` and
    ``handle.metrics()``): CPU memory and, where ranks used one, GPU memory over the seconds
    since ``started``; then one chart per metric, over steps where every record has one."""
    cpu: dict[int, list[tuple[float, float]]] = {}
    gpu: dict[int, list[tuple[float, float]]] = {}
    cpu_kind = ""
    for record in memory:
        at = record["time"] - started
        if record.get("gpu_allocated") is not None:
            gpu.setdefault(record["rank"], []).append((at, shown_bytes(record)[1]))
        kind, value = shown_cpu_bytes(record)
        cpu_kind = cpu_kind or kind
        cpu.setdefault(record["rank"], []).append((at, value))
    charts = []
    if cpu:
        charts.append(Chart(f"memory: {cpu_kind if cpu_kind != 'CPU' else 'CPU resident'}", "seconds", cpu, bytes=True, since_start=True))
    if gpu:
        charts.append(Chart("memory: GPU", "seconds", gpu, bytes=True, since_start=True))
    by_name: dict[str, dict[int, list[tuple[float | None, float, float]]]] = {}  # name -> rank -> (step, seconds, value)
    stepless: set[str] = set()  # names with a record that has no step: drawn over seconds
    for record in metrics:
        step, at, rank = record.get("step"), record["time"] - started, record["rank"]
        for name, value in record.items():
            if name in _NOT_METRICS or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            by_name.setdefault(name, {}).setdefault(rank, []).append((step, at, float(value)))
            if step is None:
                stepless.add(name)
    for name, ranks in by_name.items():
        over_steps = name not in stepless
        series = {rank: [(float(s) if over_steps and s is not None else t, v) for s, t, v in points] for rank, points in ranks.items()}
        charts.append(Chart(name, "step" if over_steps else "seconds", series, since_start=not over_steps))
    return charts


def charts_html(charts: Sequence[Chart], width: int = 380, height: int = 200) -> str:
    """The charts side by side, wrapping as the cell narrows."""
    return "".join(
        f'<div style="display:inline-block;margin:2px 6px 2px 0">{chart.svg(width, height)}</div>' for chart in charts
    )


# -- drawing --------------------------------------------------------------------


def _thinned(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """At most about MAX_POINTS points, the first and last kept, and each bucket's lowest and
    highest, so a spike stays visible."""
    if len(points) <= MAX_POINTS:
        return points
    size = math.ceil(len(points) / (MAX_POINTS // 2))
    kept = {points[0], points[-1]}
    for start in range(0, len(points), size):
        bucket = points[start:start + size]
        kept.add(min(bucket, key=lambda p: p[1]))
        kept.add(max(bucket, key=lambda p: p[1]))
    return sorted(kept)


def _ticks(low: float, high: float, count: int = 4) -> list[float]:
    """Round values (1, 2, 2.5, 5 times a power of ten apart) spanning ``low`` to ``high``."""
    if high <= low:
        return [low]
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _number(value: float) -> str:
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.2g}"
    return f"{value:.4g}"


def _byte_unit(top: float) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= scale:
            return float(scale), unit
    return 1.0, "B"


def _range(values: list[float], from_zero: bool) -> tuple[float, float]:
    low, high = min(values), max(values)
    if from_zero:
        low = min(low, 0.0)
    if high - low <= abs(high) * 1e-9:  # one value: give it room
        pad = abs(high) * 0.1 or 1.0
        return low - pad, high + pad
    return low, high + (high - low) * 0.05


def _chart_svg(chart: Chart, width: int, height: int) -> str:
    series = {rank: _thinned(sorted(points)) for rank, points in sorted(chart.series.items()) if points}
    xs = [x for points in series.values() for x, _ in points]
    ys = [y for points in series.values() for _, y in points]
    scale, unit = _byte_unit(max(map(abs, ys))) if chart.bytes else (1.0, "")
    ys = [y / scale for y in ys]
    title = chart.title + (f" ({unit})" if unit else "")
    left, right, top, bottom = 52, 10, 24, 30
    legend_y, legend_width = 10, sum(26 + 6 * len(f"rank {rank}") for rank in series)
    if left + 6.5 * len(title) + 12 > width - right - legend_width:  # no room beside the title: a row of its own
        legend_y, top = 26, 38
    inner_w, inner_h = width - left - right, height - top - bottom
    # Over seconds, from the start: a quick job's points sit where they came, not spread over 20 ms,
    # and clear of the frame's right edge.
    x_low = min(0.0, min(xs)) if chart.since_start else min(xs)
    x_low, x_high = (x_low, max(xs)) if max(xs) > x_low else (x_low - 1, max(xs) + 1)
    if chart.since_start:
        x_high += (x_high - x_low) * 0.04
    y_low, y_high = _range(ys, from_zero=chart.bytes)
    x_ticks, y_ticks = _ticks(x_low, x_high), _ticks(y_low, y_high)
    y_low, y_high = min(y_low, y_ticks[0]), max(y_high, y_ticks[-1])

    def px(x: float) -> float:
        return left + (x - x_low) / (x_high - x_low) * inner_w

    def py(y: float) -> float:
        return top + inner_h - (y - y_low) / (y_high - y_low) * inner_h

    parts = [f'<rect x="{left}" y="{top}" width="{inner_w}" height="{inner_h}" fill="#fff" stroke="#ccc"/>']
    for tick in y_ticks:
        y = py(tick)
        parts.append(f'<line x1="{left}" x2="{left + inner_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" {_FONT}>{_number(tick)}</text>')
    for tick in x_ticks:
        x = px(tick)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + inner_h}" stroke="#f3f3f3"/>')
        parts.append(f'<text x="{x:.1f}" y="{top + inner_h + 13}" text-anchor="middle" {_FONT}>{_number(tick)}</text>')
    parts.append(f'<text x="{left + inner_w / 2:.1f}" y="{height - 3}" text-anchor="middle" {_FONT}>{html.escape(chart.x_label)}</text>')
    parts.append(f'<text x="{left}" y="14" {_FONT} font-weight="bold">{html.escape(title)}</text>')
    legend_x = width - right
    for rank in reversed(list(series)):  # right-aligned, rank 0 leftmost
        label = f"rank {rank}"
        legend_x -= 8 + 6 * len(label)
        color = PALETTE[rank % len(PALETTE)]
        parts.append(f'<line x1="{legend_x - 14}" x2="{legend_x - 3}" y1="{legend_y}" y2="{legend_y}" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{legend_x}" y="{legend_y + 4}" {_FONT}>{label}</text>')
        legend_x -= 18
    for rank, points in series.items():
        color = PALETTE[rank % len(PALETTE)]
        scaled = [(px(x), py(y / scale)) for x, y in points]
        last_x, last_y = points[-1]
        tip = f"rank {rank}: {_number(last_y / scale)}{' ' + unit if unit else ''} at {chart.x_label} {_number(last_x)}"
        spread = max(x for x, _ in scaled) - min(x for x, _ in scaled) + max(y for _, y in scaled) - min(y for _, y in scaled)
        if spread < 3:  # one point, or points a few pixels apart (a quick job's): a line that short would not show
            x, y = scaled[-1]
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"><title>{html.escape(tip)}</title></circle>')
            continue
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in scaled)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{path}"><title>{html.escape(tip)}</title></polyline>')
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{html.escape(title)}">{"".join(parts)}</svg>'
    )
