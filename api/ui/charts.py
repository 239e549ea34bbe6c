"""Geometry of the dashboard's SVG charts; the Jinja macros in templates/_charts.html draw it.

Hand-written rather than a chart library: two small charts, drawn on the server as SVG
that tests can read (points, labels) and CSS variables can theme; no JavaScript needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from api.ui.views import ComparePoint

__all__ = [
    "BOTTOM",
    "HEIGHT",
    "LEFT",
    "RIGHT",
    "TOP",
    "WIDTH",
    "BarChart",
    "Scatter",
    "Tick",
    "benchmark_chart",
    "nice_max",
    "scatter_chart",
]

WIDTH, HEIGHT = 560, 300
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 16, 44


@dataclass
class Bar:
    x: float
    y: float
    w: float
    h: float
    series: str
    label: str


@dataclass
class Tick:
    pos: float
    label: str


@dataclass
class BarChart:
    width: int
    height: int
    bars: list[Bar]
    xticks: list[Tick]
    yticks: list[Tick]
    title: str


def nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * exp:
            return m * exp
    return 10 * exp


def benchmark_chart(rows: list[dict[str, Any]], title: str) -> BarChart:
    """Return p50 and p99 latency bars per batch size."""
    rows = sorted(rows, key=lambda r: r.get("batch_size", 0))
    top = nice_max(max((float(r.get("p99_ms", 0)) for r in rows), default=1.0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    group = plot_w / max(len(rows), 1)
    bar_w = min(group / 3, 48)
    bars, xticks = [], []
    for i, r in enumerate(rows):
        x0 = LEFT + i * group + (group - 2 * bar_w) / 2
        for j, series in enumerate(("p50", "p99")):
            v = float(r.get(f"{series}_ms", 0))
            h = plot_h * v / top
            bars.append(
                Bar(
                    x0 + j * bar_w,
                    TOP + plot_h - h,
                    bar_w - 2,
                    h,
                    series,
                    f"batch {r['batch_size']} {series} {v:.3f} ms",
                )
            )
        xticks.append(Tick(LEFT + i * group + group / 2, f"batch {r['batch_size']}"))
    yticks = [Tick(TOP + plot_h * (1 - k / 4), f"{top * k / 4:g}") for k in range(5)]
    return BarChart(WIDTH, HEIGHT, bars, xticks, yticks, title)


@dataclass
class ScatterPoint:
    cx: float
    cy: float
    point: ComparePoint
    label_dy: float = -6.0  # label above the point; every other one below, so neighbours do not overlap


@dataclass
class Scatter:
    width: int
    height: int
    points: list[ScatterPoint]
    front: str  # SVG path of the Pareto front
    bounds: list[tuple[float, str]]  # tolerance lines: y, label
    xticks: list[Tick]
    yticks: list[Tick]
    xlabel: str
    ylabel: str
    title: str


def _nines(v: float) -> float:
    # Accuracy near 1 spreads over decades: 0.9, 0.99, 0.999 ... sit one step apart.
    return -math.log10(max(1.0 - v, 1e-7))


def scatter_chart(points: list[ComparePoint], required: float | None, xlabel: str, ylabel: str, title: str) -> Scatter:
    """Return latency (x, linear from 0) against accuracy (y, in nines: 0.9, 0.99, ...).

    The tolerance line is at ``required``; points below it are greyed (they do not pass).
    """
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    xmax = nice_max(max((p.latency_ms for p in points), default=1.0) * 1.1)
    ys = [_nines(p.accuracy) for p in points] + ([_nines(required)] if required is not None else [])
    ylo = math.floor(min(ys, default=0.0))
    yhi = max(math.ceil(max(ys, default=1.0)), ylo + 1)

    def sx(v: float) -> float:
        return LEFT + plot_w * v / xmax

    def sy(v: float) -> float:
        return TOP + plot_h * (1 - (_nines(v) - ylo) / (yhi - ylo))

    placed = [ScatterPoint(round(sx(p.latency_ms), 1), round(sy(p.accuracy), 1), p) for p in points]
    for i, s in enumerate(sorted(placed, key=lambda s: (s.cy, s.cx))):
        s.label_dy = -6.0 if i % 2 == 0 else 16.0
    front = sorted((s for s in placed if s.point.on_front), key=lambda s: s.cx)
    path = " ".join(f"{'M' if i == 0 else 'L'}{s.cx},{s.cy}" for i, s in enumerate(front))
    bounds = [(round(sy(required), 1), f"required ≥ {required:g}")] if required is not None else []
    xticks = [Tick(sx(xmax * k / 4), f"{xmax * k / 4:g}") for k in range(5)]
    yticks = [Tick(TOP + plot_h * (1 - (n - ylo) / (yhi - ylo)), f"{1 - 10**-n:g}") for n in range(ylo, yhi + 1)]
    return Scatter(WIDTH, HEIGHT, placed, path, bounds, xticks, yticks, xlabel, ylabel, title)
