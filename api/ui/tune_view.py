"""What a tune job's page shows: its candidates as they arrive, the recommendation, and its charts.

While the search runs, the rows come from its progress events (services/tune/step.py): each
precision's builds as they finish, then every candidate with its timing; once the step is done,
from its report (GET /jobs/{id}'s ``tune``), which has the profiles and the serving curve too.
"""

from __future__ import annotations

import math
from typing import Any

from api.schemas import JobPublic
from api.ui.tune_charts import curve_chart, profile_chart, tune_scatter
from services.jobs.store import JobStore

__all__ = ["tune_events", "tune_panel"]


def tune_events(jobs: JobStore, job_id: str) -> list[dict[str, Any]]:
    """Return the ``tune`` data of the job's progress events, oldest first, each with its line."""
    out: list[dict[str, Any]] = []
    after = 0
    while True:
        batch = jobs.events(job_id, after, limit=1000)
        for ev in batch:
            data = ev.data or {}
            if ev.type == "progress" and isinstance(data.get("tune"), dict):
                out.append({**data["tune"], "line": str(data.get("message", ""))})
        if len(batch) < 1000:
            return out
        after = batch[-1].id


def _settings_text(settings: dict[str, Any] | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (settings or {}).items()) or "defaults"


def _number(value: Any) -> float | None:
    """Return ``value`` as a finite float, or None (the rows come from a sandboxed step's data)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _row(c: Any, recommended: str | None) -> dict[str, Any] | None:
    """Return a candidate (a report's, an event's) as a table row; None for anything that is not one."""
    if not isinstance(c, dict):
        return None
    parity = c["parity"] if isinstance(c.get("parity"), dict) else {}
    violations = [str(v) for v in c.get("violations") or [] if isinstance(v, str)]
    note = str(c.get("reason") or "; ".join(violations) or "")
    settings = c["settings"] if isinstance(c.get("settings"), dict) else {}
    return {
        "id": str(c.get("id", "")),
        "target": str(c.get("target", "?")),
        "precision": str(c.get("precision", "?")),
        "settings_text": _settings_text(settings),
        "batch": c.get("batch", "-") if isinstance(c.get("batch", "-"), int | str) else "-",
        "status": str(c.get("status", "")),
        "p50_ms": _number(c.get("p50_ms")),
        "p99_ms": _number(c.get("p99_ms")),
        "iqr_ms": _number(c.get("iqr_ms")),
        "throughput": _number(c.get("throughput")),
        "artifact_bytes": _number(c.get("artifact_bytes")),
        "min_snr_db": _number(c.get("min_snr_db", parity.get("min_snr_db"))),
        # The accuracy floor's score (spec.evaluation): the summary's `accuracy`, the full row's evaluation.
        "accuracy": _number(c.get("accuracy", (c.get("evaluation") or {}).get("artifact"))),
        "meets": c.get("meets_constraints") is True,
        "note": note[:160],
        "recommended": recommended is not None and c.get("id") == recommended,
    }


def _rows(candidates: Any, recommended: str | None) -> list[dict[str, Any]]:
    rows = [_row(c, recommended) for c in candidates] if isinstance(candidates, list) else []
    return [r for r in rows if r is not None]


def _built_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return one untimed row per (target, precision) built so far."""
    rows = []
    for e in events:
        if e.get("type") != "tune_built":
            continue
        built = e.get("built")
        for b in built if isinstance(built, list) else []:
            if not isinstance(b, dict):
                continue
            status = "built: waiting to be timed" if b.get("status") == "built" else b.get("status")
            error = b["error"] if isinstance(b.get("error"), dict) else {}
            row = _row({**b, "status": status, "reason": error.get("message")}, None)
            if row is not None:
                rows.append({**row, "id": f"{row['target']}/{row['precision']}", "settings_text": "—", "batch": "—"})
    return rows


def _other_profiles(profiles: dict[str, Any]) -> list[tuple[str, Any]]:
    """Return (label, chart) for each profile besides the recommendation's: the runner-up's, and the
    fastest candidate's of each engine with a profiler when neither of those ran on it."""
    out = []
    for role, profile in profiles.items():
        chart = profile_chart(profile) if role != "recommendation" else None
        if chart is not None:
            label = "the runner-up" if role == "runner_up" else f"the fastest {role.removeprefix('best_')} candidate"
            out.append((label, chart))
    return out


def _ranking(objective: str) -> Any:
    """Return the sort key of the rows: the recommendation first, then best first by the objective, untimed last."""

    def key(r: dict[str, Any]) -> tuple[bool, bool, float]:
        if objective == "throughput":
            value = -(r["throughput"] or 0.0)
        elif objective == "size":
            value = float(r["artifact_bytes"] or 0)
        else:
            value = r["p50_ms"] or 0.0
        return (not r["recommended"], r["p50_ms"] is None, value)

    return key


def tune_panel(job: JobPublic, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the tune section of the job page: phase, candidate rows, recommendation, charts."""
    report = job.tune
    options: dict[str, Any] = next(
        (s["options"].get("tune", {}) for s in job.plan.get("steps", []) if s["kind"] == "tune"), {}
    )
    if report is not None:
        rec = report.get("recommendation")
        rec_id = rec["id"] if rec else None
        rows = _rows(report.get("candidates"), rec_id)
        profile = (rec or {}).get("profile")
        curve = ((rec or {}).get("serving") or {}).get("curve")
        phase = "done"
    else:
        latest = next((e for e in reversed(events) if e.get("type") == "tune_candidates"), None)
        rec = next((e for e in reversed(events) if e.get("type") == "tune_recommendation"), None)
        if rec is not None and not (isinstance(rec.get("id"), str) and _number(rec.get("p50_ms")) is not None):
            rec = None  # the page draws a recommendation only as the search reports one
        rec_id = rec["id"] if rec else None
        rows = _rows(latest.get("candidates"), rec_id) if latest else _built_rows(events)
        profile, curve = None, None
        phase = events[-1]["line"] if events else ("waiting for a worker" if job.status == "queued" else "starting")
    rows.sort(key=_ranking(str(options.get("objective", "latency"))))
    return {
        "options": options,
        "phase": phase,
        "running": report is None and job.status in ("queued", "running"),
        "rows": rows,
        "timed": sum(r["p50_ms"] is not None for r in rows),
        "recommendation": rec,
        "report": report,
        "scatter": tune_scatter(rows, rec_id),
        "profile": profile_chart(profile),
        "other_profiles": _other_profiles((report or {}).get("profiles") or {}),
        "curve": curve_chart(curve),
    }
