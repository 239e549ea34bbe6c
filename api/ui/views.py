"""What the dashboard's pages show, computed from the API's public schemas (no HTML here).

The job grid (a row per target, a column per step kind), parity headroom per output, and
the compare view's points with their Pareto front.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from api.schemas import JobPublic, StepPublic, TargetPublic

__all__ = [
    "STATUS_ICONS",
    "STEP_COLUMNS",
    "TUNE_COLUMNS",
    "ComparePoint",
    "GridRow",
    "OutputHeadroom",
    "compare_points",
    "divergent_node",
    "job_grid",
    "output_headroom",
    "pareto_front",
    "step_columns",
    "waiting_reason",
]

STEP_COLUMNS = ("reference", "optimize", "convert", "export", "publish")
#: A tune job's steps (services/tune/plan.py): the search, then the publish of its recommendation.
TUNE_COLUMNS = ("tune", "publish")


def step_columns(job: JobPublic) -> tuple[str, ...]:
    """Return the step kinds the job's grid has a column for."""
    return TUNE_COLUMNS if job.kind == "tune" else STEP_COLUMNS


#: Status as a symbol and a word: the grid never says it by colour alone.
STATUS_ICONS = {
    "pending": "○",
    "queued": "◷",
    "running": "▶",
    "succeeded": "✓",
    "failed": "✗",
    "skipped": "↷",
    "cancelled": "⊘",
}


@dataclass
class GridRow:
    target: TargetPublic
    cells: dict[str, list[StepPublic]]


def job_grid(job: JobPublic) -> list[GridRow]:
    """Return a row per target with, per step kind, the steps of its route (shared ones included)."""
    steps = {s.id: s for s in job.steps}
    rows = []
    for target in job.targets.values():
        cells: dict[str, list[StepPublic]] = {k: [] for k in step_columns(job)}
        for step_id in target.steps:
            step = steps.get(step_id)
            if step is not None:
                cells.setdefault(step.kind, []).append(step)
        rows.append(GridRow(target=target, cells=cells))
    return rows


def waiting_reason(step: StepPublic, live_engines: set[str]) -> str | None:
    """Say why a queued step waits when no live worker serves its engine."""
    if step.status == "queued" and step.engine not in live_engines:
        return f"waiting: no live worker serves {step.engine} (queue {step.queue})"
    return None


@dataclass
class OutputHeadroom:
    """One parity metric of one output against its bound: how much of the tolerance it uses."""

    output: str
    metric: str
    value: float
    bound: float | None
    used: float | None  # 0 = exact, 1 = at the bound, > 1 = outside
    ok: bool


def _used(error: float, allowed: float) -> float:
    error = max(error, 0.0)  # 1 - cosine can be a rounding hair below zero
    if allowed <= 0:
        return 0.0 if error <= 0 else math.inf
    return error / allowed


def output_headroom(parity: dict[str, Any] | None) -> list[OutputHeadroom]:
    """Return each output's metrics with the share of its tolerance used (for the headroom bars)."""
    if not parity:
        return []
    tol = parity.get("tolerances") or {}
    out = []
    for o in parity.get("outputs", []):
        name = o.get("name", "?")
        # The elementwise bound as applied: atol scaled by the output's peak (services/validation/metrics.py).
        atol = o.get("atol_used") if o.get("atol_used") is not None else tol.get("atol")
        if o.get("max_abs") is not None:
            used = _used(o["max_abs"], atol) if atol is not None else None
            out.append(OutputHeadroom(name, "max abs error", o["max_abs"], atol, used, used is None or used <= 1))
        min_cos = tol.get("min_cosine")
        if o.get("cosine") is not None:
            used = _used(1 - o["cosine"], 1 - min_cos) if min_cos is not None else None
            out.append(
                OutputHeadroom(name, "cosine (worst sample)", o["cosine"], min_cos, used, used is None or used <= 1)
            )
        min_r = tol.get("min_pearson")
        if o.get("pearson") is not None:
            used = _used(1 - o["pearson"], 1 - min_r) if min_r is not None else None
            out.append(
                OutputHeadroom(name, "Pearson (worst sample)", o["pearson"], min_r, used, used is None or used <= 1)
            )
        min_snr = tol.get("min_snr_db")
        if o.get("snr_db") is not None:
            # Headroom in noise power: at the bound the error's power is 10^(-bound/10) of the signal's.
            used = 10 ** ((min_snr - o["snr_db"]) / 10) if min_snr is not None else None
            out.append(
                OutputHeadroom(name, "SNR dB (worst sample)", o["snr_db"], min_snr, used, used is None or used <= 1)
            )
        max_scale = tol.get("max_scale_error")
        if o.get("scale") is not None:
            used = _used(abs(o["scale"] - 1), max_scale) if max_scale is not None else None
            out.append(
                OutputHeadroom(name, "scale (slope, ideal 1)", o["scale"], max_scale, used, used is None or used <= 1)
            )
        max_bias = tol.get("max_bias")
        if o.get("bias") is not None:
            used = _used(abs(o["bias"]), max_bias) if max_bias is not None else None
            out.append(OutputHeadroom(name, "bias (std devs)", o["bias"], max_bias, used, used is None or used <= 1))
        out.extend(_interval_headroom(name, o.get("intervals") or {}, tol))
        min_top1 = tol.get("min_top1")
        if o.get("top1") is not None:
            used = _used(1 - o["top1"], 1 - min_top1) if min_top1 is not None else None
            label = f"top-1 agreement ({o.get('top1_positions') or '?'} positions)"
            out.append(OutputHeadroom(name, label, o["top1"], min_top1, used, used is None or used <= 1))
    return out


def _interval_headroom(name: str, intervals: dict[str, Any], tol: dict[str, Any]) -> list[OutputHeadroom]:
    """Return the pessimistic end of each measure's prediction bound against its bound (what the gate decides on)."""
    out = []
    for metric, label, key in (
        ("pearson", "Pearson", "min_pearson"),
        ("snr_db", "SNR dB", "min_snr_db"),
    ):
        iv = intervals.get(metric)
        if not iv or iv.get("pessimistic") is None:
            continue
        value, bound = float(iv["pessimistic"]), tol.get(key)
        if bound is None:
            used = None
        elif metric == "snr_db":
            used = 10 ** ((bound - value) / 10)
        else:
            used = _used(1 - value, 1 - bound)
        what = f"{label} (next unseen input, {float(iv['confidence']):.0%} bound over {iv['n']} samples)"
        out.append(OutputHeadroom(name, what, value, bound, used, used is None or used <= 1))
    return out


def divergent_node(parity: dict[str, Any] | None) -> dict[str, Any] | None:
    """Return the localisation of a parity report when it names a node (for the error card)."""
    loc = (parity or {}).get("localization") or {}
    return loc if loc.get("node") else None


@dataclass
class ComparePoint:
    job_id: str
    target: str
    precision: str
    latency_ms: float
    accuracy: float
    bound: float | None
    passed: bool
    link: str
    on_front: bool = False
    label: str = field(init=False)

    def __post_init__(self) -> None:
        self.label = f"{self.target} {self.precision}"


def compare_points(
    jobs: list[JobPublic], batch: int, latency: str, accuracy: str, required: float | None = None
) -> list[ComparePoint]:
    """Return one point per engine x precision with a benchmark at ``batch`` and a parity report.

    ``latency`` is p50 or p99; ``accuracy`` is cosine or top1, of the worst output, or task:
    the artifact's score on the spec's labelled data (metrics where higher is better), whose
    bound is the accuracy floor (the source's score less max_drop). A point passes when its own
    parity check (and evaluation) passed and its accuracy reaches ``required`` (the tolerance
    line the viewer picked). The newest job wins when several built the same engine x precision.
    """
    seen: set[tuple[str, str]] = set()
    points = []
    for job in jobs:  # newest first
        precision = str(job.spec.get("precision", "fp32"))
        for target in job.targets.values():
            key = (target.target, precision)
            if key in seen or not target.parity:
                continue
            row = next((b for b in target.benchmark if b.get("batch_size") == batch), None)
            task = target.evaluation or {}
            if accuracy == "task":
                higher = task.get("higher_is_better") and task.get("artifact") is not None
                values = [task["artifact"]] if higher else []
            else:
                values = [o.get(accuracy) for o in target.parity.get("outputs", []) if o.get(accuracy) is not None]
            if row is None or not values:
                continue
            seen.add(key)
            tol = target.parity.get("tolerances") or {}
            if accuracy == "task":
                tol = {"task": round(float(task["source"]) - float(task["max_drop"]), 6)}
            pub = target.published or {}
            link = f"/ui/repository/{pub['name']}/{pub['version']}" if pub.get("name") else f"/ui/jobs/{job.id}"
            worst = float(min(values))
            points.append(
                ComparePoint(
                    job_id=job.id,
                    target=target.target,
                    precision=precision,
                    latency_ms=float(row[f"{latency}_ms"]),
                    accuracy=worst,
                    bound=tol.get({"cosine": "min_cosine", "top1": "min_top1"}.get(accuracy, accuracy)),
                    passed=bool(target.parity.get("passed"))
                    and task.get("passed") is not False
                    and (required is None or worst >= required),
                    link=link,
                )
            )
    pareto_front(points)
    return points


def pareto_front(points: list[ComparePoint]) -> list[ComparePoint]:
    """Mark and return the passing points no other passing point beats on both latency and accuracy."""
    passing = sorted((p for p in points if p.passed), key=lambda p: (p.latency_ms, -p.accuracy))
    front = []
    best = -math.inf
    for p in passing:  # fastest first: a point is on the front if more accurate than every faster one
        if p.accuracy > best:
            p.on_front = True
            front.append(p)
            best = p.accuracy
    return front
