"""Geometry of a tune's charts (drawn by templates/_tune.html as SVG, like api/ui/charts.py's).

- the candidates' latency against accuracy (worst output's SNR against the source), with the
  Pareto front of those meeting every constraint and the recommendation marked;
- the recommendation's per-layer profile: time per operator type, largest first;
- the throughput-vs-concurrency curve the throughput objective picks batch × instances from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from api.ui.charts import BOTTOM, HEIGHT, LEFT, RIGHT, TOP, WIDTH, Tick, nice_max

__all__ = ["CurveChart", "ProfileChart", "TuneScatter", "curve_chart", "profile_chart", "tune_scatter"]

#: SNR shown for outputs identical to the source's (their SNR is unbounded).
_SNR_CAP_DB = 200.0


@dataclass
class TunePoint:
    cx: float
    cy: float
    label: str
    p50_ms: float
    snr_db: float | None
    qualifies: bool  # passed parity, was timed and meets every constraint
    on_front: bool = False
    recommended: bool = False


@dataclass
class TuneScatter:
    width: int
    height: int
    points: list[TunePoint]
    front: str
    xticks: list[Tick]
    yticks: list[Tick]
    title: str


def _snr(row: dict[str, Any]) -> float | None:
    v = row.get("min_snr_db")
    if v is None:
        return None
    v = float(v)
    if math.isnan(v) or v == -math.inf:
        return None  # no agreement measured (a zero signal, a NaN): drawn at the bottom
    return min(v, _SNR_CAP_DB)  # identical outputs have an unbounded SNR


def _front(points: list[TunePoint]) -> list[TunePoint]:
    """Return the qualifying points no other qualifying point beats on both latency and SNR."""
    ok = [p for p in points if p.qualifies and p.snr_db is not None]
    out = []
    for p in ok:
        dominated = any(
            q.p50_ms <= p.p50_ms and (q.snr_db or 0) >= (p.snr_db or 0) and (q.p50_ms, q.snr_db) != (p.p50_ms, p.snr_db)
            for q in ok
        )
        if not dominated:
            out.append(p)
    return out


def tune_scatter(rows: list[dict[str, Any]], recommended: str | None) -> TuneScatter | None:
    """Return p50 latency (x) against the worst output's SNR in dB (y) for the timed candidates."""
    timed = [r for r in rows if r.get("p50_ms") is not None]
    if not timed:
        return None
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    xmax = nice_max(max(float(r["p50_ms"]) for r in timed) * 1.1)
    snrs = [s for s in (_snr(r) for r in timed) if s is not None]
    ylo = math.floor(min(snrs, default=0.0) / 10) * 10 - 10 if snrs else 0.0
    yhi = max(nice_max(max(snrs, default=1.0)), ylo + 10)

    def sx(v: float) -> float:
        return round(LEFT + plot_w * v / xmax, 1)

    def sy(v: float | None) -> float:
        return round(TOP + plot_h * (1 - ((ylo if v is None else v) - ylo) / (yhi - ylo)), 1)

    points = [
        TunePoint(
            sx(float(r["p50_ms"])),
            sy(_snr(r)),
            f"{r['target']} {r['precision']} {r['settings_text']} b{r['batch']}",
            float(r["p50_ms"]),
            _snr(r),
            bool(r.get("meets")),
            recommended=r["id"] == recommended,
        )
        for r in timed
    ]
    front = sorted(_front(points), key=lambda p: p.cx)
    for p in front:
        p.on_front = True
    path = " ".join(f"{'M' if i == 0 else 'L'}{p.cx},{p.cy}" for i, p in enumerate(front))
    xticks = [Tick(sx(xmax * k / 4), f"{xmax * k / 4:g}") for k in range(5)]
    yticks = [Tick(sy(ylo + (yhi - ylo) * k / 4), f"{ylo + (yhi - ylo) * k / 4:g}") for k in range(5)]
    title = f"Candidates: p50 latency against accuracy ({len(points)} timed, {len(front)} on the Pareto front)"
    return TuneScatter(WIDTH, HEIGHT, points, path, xticks, yticks, title)


@dataclass
class ProfileBar:
    y: float
    w: float
    op_type: str
    ms: float
    share: float
    nodes: int


@dataclass
class ProfileChart:
    width: int
    height: int
    bars: list[ProfileBar]
    label_x: int
    title: str
    notes: list[str] = field(default_factory=list)


def profile_chart(profile: dict[str, Any] | None, top: int = 10) -> ProfileChart | None:
    """Return horizontal bars of time per operator type (ms per run), largest first."""
    if not profile or not profile.get("available") or not profile.get("top_ops"):
        return None
    ops = sorted(profile["top_ops"], key=lambda o: -float(o["ms_per_run"]))[:top]
    label_x, row = 150, 22
    width = WIDTH
    plot_w = width - label_x - 90
    most = max(float(o["ms_per_run"]) for o in ops) or 1.0
    bars = [
        ProfileBar(
            TOP + i * row,
            round(max(plot_w * float(o["ms_per_run"]) / most, 1.0), 1),
            str(o["op_type"]),
            float(o["ms_per_run"]),
            float(o.get("share", 0.0)),
            int(o.get("nodes", 0)),
        )
        for i, o in enumerate(ops)
    ]
    notes = []
    if profile.get("time_by_exec_precision"):
        shares = ", ".join(f"{k} {v:.0%}" for k, v in profile["time_by_exec_precision"].items())
        notes.append(f"executed in: {shares}")
    title = f"Where the time goes: {profile.get('candidate', '')} ({float(profile.get('total_ms_per_run', 0)):.3f} ms/run in operators)"
    return ProfileChart(width, TOP + len(bars) * row + 8, bars, label_x, title, notes)


@dataclass
class CurveLine:
    batch: int
    path: str
    points: list[tuple[float, float, int, float]]  # cx, cy, instances, samples/s


@dataclass
class CurveChart:
    width: int
    height: int
    lines: list[CurveLine]
    pick: tuple[float, float] | None
    xticks: list[Tick]
    yticks: list[Tick]
    title: str


def curve_chart(curve: dict[str, Any] | None) -> CurveChart | None:
    """Return throughput (y) against concurrent instances (x), one line per batch size, the pick marked."""
    if not curve or not curve.get("points"):
        return None
    pts = [p for p in curve["points"] if p.get("throughput") is not None]
    if not pts:
        return None
    levels = list(curve["concurrency"])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    ymax = nice_max(max(float(p["throughput"]) for p in pts) * 1.1)

    def sx(n: int) -> float:
        return round(LEFT + plot_w * (levels.index(n) + 0.5) / len(levels), 1)

    def sy(v: float) -> float:
        return round(TOP + plot_h * (1 - v / ymax), 1)

    lines = []
    for b in curve["batches"]:
        mine = sorted((p for p in pts if p["batch"] == b), key=lambda p: levels.index(p["instances"]))
        coords = [
            (sx(p["instances"]), sy(float(p["throughput"])), int(p["instances"]), float(p["throughput"])) for p in mine
        ]
        path = " ".join(f"{'M' if i == 0 else 'L'}{x},{y}" for i, (x, y, _, _) in enumerate(coords))
        lines.append(CurveLine(int(b), path, coords))
    pick = curve.get("pick")
    marked = (sx(pick["instances"]), sy(float(pick["throughput"]))) if pick and pick.get("throughput") else None
    xticks = [Tick(sx(n), f"{n}") for n in levels]
    yticks = [Tick(sy(ymax * k / 4), f"{ymax * k / 4:g}") for k in range(5)]
    title = f"Throughput against concurrent instances: {curve.get('candidate', '')} (samples/s)"
    return CurveChart(WIDTH, HEIGHT, lines, marked, xticks, yticks, title)
