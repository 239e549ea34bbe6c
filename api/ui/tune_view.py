"""What a tune job's page shows: its candidates as they arrive, the recommendation, and its charts.

While the search runs, the rows come from its progress events (services/tune/step.py): each
precision's builds as they finish, then every candidate with its timing; once the step is done,
from its report (GET /jobs/{id}'s ``tune``), which has the profiles and the serving curve too.
"""

from __future__ import annotations

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
                out.append({**data["tune"], "line": data.get("message", "")})
        if len(batch) < 1000:
            return out
        after = batch[-1].id


def _settings_text(settings: dict[str, Any] | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (settings or {}).items()) or "defaults"


def _row(c: dict[str, Any], recommended: str | None) -> dict[str, Any]:
    """Return a candidate (a report's, an event's) as a table row."""
    parity = c.get("parity") or {}
    violations = c.get("violations") or []
    note = c.get("reason") or "; ".join(violations) or ""
    return {
        "id": c.get("id", ""),
        "target": c["target"],
        "precision": c["precision"],
        "settings_text": _settings_text(c.get("settings")),
        "batch": c.get("batch", "-"),
        "status": c.get("status", ""),
        "p50_ms": c.get("p50_ms"),
        "p99_ms": c.get("p99_ms"),
        "iqr_ms": c.get("iqr_ms"),
        "throughput": c.get("throughput"),
        "artifact_bytes": c.get("artifact_bytes"),
        "min_snr_db": c.get("min_snr_db", parity.get("min_snr_db")),
        "meets": bool(c.get("meets_constraints")),
        "note": note[:160],
        "recommended": c.get("id") == recommended,
    }


def _built_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return one untimed row per (target, precision) built so far."""
    rows = []
    for e in events:
        if e.get("type") != "tune_built":
            continue
        for b in e.get("built", []):
            status = "built: waiting to be timed" if b["status"] == "built" else b["status"]
            error = b.get("error") or {}
            rows.append(
                {
                    **_row({**b, "status": status, "reason": error.get("message")}, None),
                    "id": f"{b['target']}/{b['precision']}",
                    "settings_text": "—",
                    "batch": "—",
                }
            )
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
        rows = [_row(c, rec_id) for c in report.get("candidates", [])]
        profile = (rec or {}).get("profile")
        curve = ((rec or {}).get("serving") or {}).get("curve")
        phase = "done"
    else:
        latest = next((e for e in reversed(events) if e.get("type") == "tune_candidates"), None)
        rec = next((e for e in reversed(events) if e.get("type") == "tune_recommendation"), None)
        rec_id = rec["id"] if rec else None
        rows = [_row(c, rec_id) for c in latest["candidates"]] if latest else _built_rows(events)
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
