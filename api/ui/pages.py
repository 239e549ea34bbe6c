"""The dashboard's job pages (GET): the jobs list, a job, its log, and the submit form."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse, Response

from api.auth import Principal
from api.routes.jobs import job_log_lines
from api.routes.service import quota_of
from api.schemas import JobPublic
from api.ui.charts import benchmark_chart
from api.ui.session import render, render_page, viewer, writer
from api.ui.tune_view import tune_events, tune_panel
from api.ui.views import divergent_node, job_grid, output_headroom, step_columns, waiting_reason
from api.views import job_public
from services.descriptors import registry
from services.graph.engines import ENGINES
from services.jobs.store import JobFilter
from services.spec import CompileSpec, Precision, TargetName

__all__ = ["router"]

router = APIRouter(prefix="/ui", include_in_schema=False)

PAGE_SIZE = 25
LOG_TAIL = 1000
_SORTS = ("created_at", "finished_at", "name", "status")
_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")


def _parse_date(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _list_query(request: Request) -> dict[str, str]:
    """Return the list's filters from the URL, unknown values dropped (a bad link shows all jobs)."""
    q = request.query_params
    out: dict[str, str] = {}
    checks = {
        "status": lambda v: v in _STATUSES,
        "target": lambda v: v in {t.value for t in TargetName},
        "engine": lambda v: v in ENGINES,
        "precision": lambda v: v in {p.value for p in Precision},
        "name": lambda v: 0 < len(v) <= 128,
        "sha": lambda v: 0 < len(v) <= 64 and all(c in "0123456789abcdefABCDEF" for c in v),
        "since": lambda v: _parse_date(v) is not None,
        "until": lambda v: _parse_date(v) is not None,
        "sort": lambda v: v.lstrip("-") in _SORTS,
        "page": lambda v: v.isdigit() and 0 < int(v) < 1_000_000,
        "tenant": lambda v: 0 < len(v) <= 64,
    }
    for key, ok in checks.items():
        value = q.get(key, "").strip()
        if value and ok(value):
            out[key] = value
    return out


def _filter(query: dict[str, str], who: Principal) -> JobFilter:
    sort = query.get("sort", "-created_at")
    until = _parse_date(query.get("until"))
    if until is not None and len(query.get("until", "")) <= 10:
        until += timedelta(days=1)  # a date means "through that day"
    # Whose jobs: the viewer's tenant's; an admin sees every tenant's, or the one picked.
    tenant = who.tenant_filter if who.tenant_filter is not None else query.get("tenant")
    return JobFilter(
        tenant=tenant,
        status=query.get("status"),
        name=query.get("name"),
        target=query.get("target"),
        engine=query.get("engine"),
        precision=query.get("precision"),
        source_sha256=query.get("sha"),
        created_after=_parse_date(query.get("since")),
        created_before=until,
        sort=sort.lstrip("-"),
        ascending=not sort.startswith("-"),
    )


def _jobs_context(request: Request, who: Principal) -> dict[str, Any]:
    query = _list_query(request)
    page = int(query.get("page", "1"))
    rows, count = request.app.state.jobs.list_jobs(
        filters=_filter(query, who), limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE, with_steps=False
    )

    def link(**change: Any) -> str:
        q = {**query, **{k: str(v) for k, v in change.items() if v is not None}}
        q = {k: v for k, v in q.items() if v and not (k == "page" and v == "1")}
        return "/ui/" + (f"?{urlencode(q)}" if q else "")

    pages = max(1, -(-count // PAGE_SIZE))
    return {
        "jobs": rows,
        "count": count,
        "query": query,
        "page": page,
        "pages": pages,
        "link": link,
        "rows_url": "/ui/jobs/rows" + (f"?{urlencode(query)}" if query else ""),
        "targets": [t.value for t in TargetName],
        "engines": ENGINES,
        "precisions": [p.value for p in Precision],
        "statuses": _STATUSES,
        "now": datetime.now(UTC),
        # With auth on, an admin sees every tenant's jobs: which is whose.
        "show_tenant": request.app.state.settings.auth_enabled and who.sees_all,
        "quota": quota_of(who, request.app.state.jobs, request.app.state.settings),
    }


@router.get("/")
async def jobs_page(request: Request) -> Response:
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    ctx = await run_in_threadpool(_jobs_context, request, who)
    return render(request, "jobs.html", who, nav="jobs", **ctx)


@router.get("/jobs/rows")
async def jobs_rows(request: Request) -> Response:
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    ctx = await run_in_threadpool(_jobs_context, request, who)
    return render(request, "_jobs_rows.html", who, **ctx)


def load_job(request: Request, who: Principal, job_id: str) -> JobPublic:
    """Return the job as its page shows it; NOT_FOUND when unknown or of a tenant ``who`` does not see."""
    state = request.app.state
    return job_public(state.jobs.get_job(job_id, who.tenant_filter), state.store)


def live_engines(request: Request) -> set[str]:
    state = request.app.state
    return {e for w in state.workers.live_workers(state.worker_max_age) for e in w.engines}


def job_context(request: Request, who: Principal, job_id: str) -> dict[str, Any]:
    """Return what the job page's live part shows (also rendered by its event stream)."""
    job = load_job(request, who, job_id)
    live = live_engines(request)
    panels = []
    for t in job.targets.values():
        panels.append(
            {
                "target": t,
                "headroom": output_headroom(t.parity),
                "divergent": divergent_node(t.parity),
                "chart": benchmark_chart(t.benchmark, f"{t.target}: latency per batch size (ms)")
                if t.benchmark
                else None,
            }
        )
    tune = tune_panel(job, tune_events(request.app.state.jobs, job_id)) if job.kind == "tune" else None
    return {
        "job": job,
        "tune": tune,
        "grid": job_grid(job),
        "columns": step_columns(job),
        "panels": panels,
        "waiting": {s.id: waiting_reason(s, live) for s in job.steps},
        "final": job.status in ("succeeded", "failed", "cancelled")
        and not any(s.status in ("queued", "running") for s in job.steps),
    }


@router.get("/jobs/{job_id}")
async def job_page(request: Request, job_id: str) -> Response:
    return await render_page(request, "job.html", job_context, job_id, nav="jobs")


@router.get("/jobs/{job_id}/live")
async def job_live(request: Request, job_id: str) -> Response:
    """The job page's live part alone (what the event stream sends, for a plain refresh)."""
    return await render_page(request, "_job_live.html", job_context, job_id)


def _log_context(request: Request, who: Principal, job_id: str) -> dict[str, Any]:
    jobs = request.app.state.jobs
    status = jobs.job_status(job_id, who.tenant_filter)
    lines = job_log_lines(jobs, job_id, who.tenant_filter)
    start = max(0, len(lines) - LOG_TAIL)
    return {
        "job_id": job_id,
        "status": status,
        "lines": lines[start:],
        "total": len(lines),
        "start": start,
        "final": status in ("succeeded", "failed", "cancelled"),
    }


@router.get("/jobs/{job_id}/log")
async def log_page(request: Request, job_id: str) -> Response:
    template = "_log_tail.html" if request.headers.get("hx-request") else "log.html"
    return await render_page(request, template, _log_context, job_id, nav="jobs")


def _spec_fields() -> dict[str, Any]:
    """Return the CompileSpec JSON Schema, with references resolved, for the submit form."""
    schema = CompileSpec.model_json_schema()
    defs = schema.get("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:  # keep the property's own keys (default, description) over the definition's
                own = {k: v for k, v in node.items() if k != "$ref"}
                return {**resolve(defs[node["$ref"].split("/")[-1]]), **resolve(own)}
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    # Deprecated spellings (tensorrt_variant: now options.tensorrt.variant) are accepted, not offered.
    props = {k: v for k, v in resolve(schema["properties"]).items() if not v.get("deprecated")}
    for prop in props.values():
        # `X | None` is an anyOf with null: the form shows X, empty meaning unset.
        options = [o for o in prop.get("anyOf", []) if o.get("type") != "null"]
        if options:
            prop.update({k: v for k, v in options[0].items() if k not in prop})
    return {"properties": props, "required": schema.get("required", [])}


def source_formats() -> dict[str, Any]:
    """Return what the upload field says it takes, and file endings -> format for the plan preview."""
    sources = [f for f in registry().formats.values() if f.is_source]
    endings = sorted(((e, f.name) for f in sources for e in f.extensions), key=lambda p: -len(p[0]))
    return {"source_labels": [f.label for f in sources], "extensions": endings}


@router.get("/submit")
async def submit_page(request: Request) -> Response:
    who = await writer(request, "submitting")
    if isinstance(who, Response):
        return who
    return render(request, "submit.html", who, nav="submit", schema=_spec_fields(), **source_formats())


@router.get("")
async def ui_root() -> Response:
    return RedirectResponse("/ui/", status_code=307)
