"""The compare page: latency against accuracy of one source model's builds, and jobs side by side."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from api.auth import Principal
from api.schemas import JobPublic
from api.ui.charts import scatter_chart
from api.ui.pages import load_job
from api.ui.session import render, viewer
from api.ui.views import compare_points
from api.views import job_public
from services.errors import NotFound
from services.jobs.store import JobFilter

__all__ = ["router"]

router = APIRouter(prefix="/ui", include_in_schema=False)


def _compare_context(request: Request, who: Principal) -> dict[str, Any]:
    q = request.query_params
    state = request.app.state
    sha = q.get("sha", "").strip().lower()
    latency = q.get("latency", "p50")
    latency = latency if latency in ("p50", "p99") else "p50"
    accuracy = q.get("accuracy", "cosine")
    accuracy = accuracy if accuracy in ("cosine", "top1", "task") else "cosine"
    batch = int(q["batch"]) if q.get("batch", "").isdigit() else 1
    ids = [i for i in q.get("jobs", "").split(",") if i][:20]
    diff = q.get("diff") == "1"
    ctx: dict[str, Any] = {
        "sha": sha,
        "latency": latency,
        "accuracy": accuracy,
        "batch": batch,
        "diff": diff,
        "required": None,
        "bounds": [],
        "points": [],
    }
    jobs: list[JobPublic] = []
    if sha and all(c in "0123456789abcdef" for c in sha):
        rows, _ = state.jobs.list_jobs(filters=JobFilter(source_sha256=sha, tenant=who.tenant_filter), limit=200)
        jobs = [job_public(j, state.store) for j in rows]
        # The tolerance line: a required accuracy the viewer picks among the precisions'
        # bounds (default: the loosest, so only points failing every bound are greyed).
        bounds = sorted({p.bound for p in compare_points(jobs, batch, latency, accuracy) if p.bound is not None})
        required = _float_in(q.get("min"), 0.0, 1.0)
        if required is None and bounds:
            required = bounds[0]
        points = compare_points(jobs, batch, latency, accuracy, required)
        ctx.update(points=points, bounds=bounds, required=required)
        ctx["chart"] = scatter_chart(
            points,
            required,
            f"{latency} latency at batch {batch} (ms)",
            {"cosine": "worst cosine", "top1": "worst top-1 agreement"}.get(accuracy, "task metric on labelled data"),
            f"Latency vs accuracy of source {sha[:12]}",
        )
        ctx["batches"] = sorted({b["batch_size"] for j in jobs for t in j.targets.values() for b in t.benchmark})
        if not ids:
            ids = [j.id for j in jobs[:6]]
    table: list[JobPublic] = []
    for job_id in ids:
        try:
            table.append(next((j for j in jobs if j.id == job_id), None) or load_job(request, who, job_id))
        except NotFound:
            continue
    ctx["table"] = _side_by_side(table, diff)
    ctx["table_jobs"] = table
    ctx["ids"] = ",".join(j.id for j in table)
    if not sha:
        recent, _ = state.jobs.list_jobs(filters=JobFilter(tenant=who.tenant_filter), limit=50, with_steps=False)
        seen: dict[str, Any] = {}
        for j in recent:
            seen.setdefault(j.source_sha256, j)
        ctx["sources"] = list(seen.values())
    return ctx


def _float_in(text: str | None, lo: float, hi: float) -> float | None:
    try:
        value = float(text or "")
    except ValueError:
        return None
    return value if lo <= value <= hi else None


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out[prefix] = json.dumps(value) if isinstance(value, list | bool) or value is None else str(value)


def _side_by_side(jobs: list[JobPublic], diff: bool) -> list[tuple[str, list[str]]]:
    """Return rows (field, value per job); with ``diff`` only the rows where the jobs differ."""
    columns = []
    for job in jobs:
        flat: dict[str, str] = {"status": job.status, "name": job.name, "source": job.source.filename}
        _flatten("spec", job.spec, flat)
        for t in job.targets.values():
            flat[f"{t.target}.status"] = t.status
            for b in t.benchmark:
                flat[f"{t.target}.p50 ms @ batch {b['batch_size']}"] = f"{b['p50_ms']:.3f}"
            if t.parity:
                cos = [o["cosine"] for o in t.parity.get("outputs", []) if o.get("cosine") is not None]
                if cos:
                    flat[f"{t.target}.worst cosine"] = f"{min(cos):.6f}"
            ev = t.evaluation or {}
            if ev.get("artifact") is not None:
                flat[f"{t.target}.{ev['metric']} (source {ev['source']:.4f})"] = (
                    f"{ev['artifact']:.4f}, drop {ev['drop']:.4f} {'≤' if ev.get('passed') else '>'} {ev['max_drop']}"
                )
        flat["seconds"] = f"{job.server_seconds:.1f}" if job.server_seconds is not None else "-"
        columns.append(flat)
    keys: list[str] = []
    for col in columns:
        keys += [k for k in col if k not in keys]
    rows = [(k, [c.get(k, "—") for c in columns]) for k in keys]
    if diff:
        rows = [r for r in rows if len(set(r[1])) > 1]
    return rows


@router.get("/compare")
async def compare_page(request: Request) -> Response:
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    ctx = await run_in_threadpool(_compare_context, request, who)
    return render(request, "compare.html", who, nav="compare", **ctx)
