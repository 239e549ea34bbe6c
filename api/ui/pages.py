"""The dashboard's pages (GET): jobs, a job, its log, submit, compare, engines, repository."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse, Response

from api.auth import ANONYMOUS
from api.routes.jobs import job_log_lines
from api.routes.service import readiness_checks
from api.routes.service import repository as repository_listing
from api.schemas import JobPublic
from api.ui.charts import benchmark_chart, scatter_chart
from api.ui.session import error_page, render, viewer
from api.ui.views import compare_points, job_grid, output_headroom, waiting_reason
from api.views import job_public
from services.errors import KilnError, NotFound
from services.graph.engines import ENGINES, queue_name
from services.jobs.store import JobFilter
from services.repository.publish import MANIFEST
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
    }
    for key, ok in checks.items():
        value = q.get(key, "").strip()
        if value and ok(value):
            out[key] = value
    return out


def _filter(query: dict[str, str]) -> JobFilter:
    sort = query.get("sort", "-created_at")
    until = _parse_date(query.get("until"))
    if until is not None and len(query.get("until", "")) <= 10:
        until += timedelta(days=1)  # a date means "through that day"
    return JobFilter(
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


def _jobs_context(request: Request) -> dict[str, Any]:
    query = _list_query(request)
    page = int(query.get("page", "1"))
    rows, count = request.app.state.jobs.list_jobs(
        filters=_filter(query), limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE, with_steps=False
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
    }


@router.get("/")
async def jobs_page(request: Request) -> Response:
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    ctx = await run_in_threadpool(_jobs_context, request)
    return render(request, "jobs.html", who, nav="jobs", **ctx)


@router.get("/jobs/rows")
async def jobs_rows(request: Request) -> Response:
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    ctx = await run_in_threadpool(_jobs_context, request)
    return render(request, "_jobs_rows.html", who, **ctx)


def load_job(request: Request, job_id: str) -> JobPublic:
    state = request.app.state
    return job_public(state.jobs.get_job(job_id), state.store)


def live_engines(request: Request) -> set[str]:
    state = request.app.state
    return {e for w in state.jobs.live_workers(state.worker_max_age) for e in w.engines}


def job_context(request: Request, job_id: str) -> dict[str, Any]:
    """Return what the job page's live part shows (also rendered by its event stream)."""
    job = load_job(request, job_id)
    live = live_engines(request)
    panels = []
    for t in job.targets.values():
        panels.append(
            {
                "target": t,
                "headroom": output_headroom(t.parity),
                "chart": benchmark_chart(t.benchmark, f"{t.target}: latency per batch size (ms)")
                if t.benchmark
                else None,
            }
        )
    return {
        "job": job,
        "grid": job_grid(job),
        "panels": panels,
        "waiting": {s.id: waiting_reason(s, live) for s in job.steps},
        "final": job.status in ("succeeded", "failed", "cancelled")
        and not any(s.status in ("queued", "running") for s in job.steps),
    }


@router.get("/jobs/{job_id}")
async def job_page(request: Request, job_id: str) -> Response:
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    try:
        ctx = await run_in_threadpool(job_context, request, job_id)
    except KilnError as exc:
        return error_page(request, who, exc)
    return render(request, "job.html", who, nav="jobs", **ctx)


@router.get("/jobs/{job_id}/live")
async def job_live(request: Request, job_id: str) -> Response:
    """The job page's live part alone (what the event stream sends, for a plain refresh)."""
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    try:
        ctx = await run_in_threadpool(job_context, request, job_id)
    except KilnError as exc:
        return error_page(request, who, exc)
    return render(request, "_job_live.html", who, **ctx)


def _log_context(request: Request, job_id: str) -> dict[str, Any]:
    jobs = request.app.state.jobs
    status = jobs.job_status(job_id)
    lines = job_log_lines(jobs, job_id)
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
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    try:
        ctx = await run_in_threadpool(_log_context, request, job_id)
    except KilnError as exc:
        return error_page(request, who, exc)
    template = "_log_tail.html" if request.headers.get("hx-request") else "log.html"
    return render(request, template, who, nav="jobs", **ctx)


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

    props = resolve(schema["properties"])
    for prop in props.values():
        # `X | None` is an anyOf with null: the form shows X, empty meaning unset.
        options = [o for o in prop.get("anyOf", []) if o.get("type") != "null"]
        if options:
            prop.update({k: v for k, v in options[0].items() if k not in prop})
    return {"properties": props, "required": schema.get("required", [])}


@router.get("/submit")
async def submit_page(request: Request) -> Response:
    who = await viewer(request, "write")
    if isinstance(who, Response):
        return who
    if not who.allows("write"):
        return error_page(request, who, NotFound("submitting needs a token with the write scope"))
    return render(request, "submit.html", who, nav="submit", schema=_spec_fields())


def _compare_context(request: Request) -> dict[str, Any]:
    q = request.query_params
    state = request.app.state
    sha = q.get("sha", "").strip().lower()
    latency = q.get("latency", "p50")
    latency = latency if latency in ("p50", "p99") else "p50"
    accuracy = q.get("accuracy", "cosine")
    accuracy = accuracy if accuracy in ("cosine", "top1") else "cosine"
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
        rows, _ = state.jobs.list_jobs(filters=JobFilter(source_sha256=sha), limit=200)
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
            "worst cosine" if accuracy == "cosine" else "worst top-1 agreement",
            f"Latency vs accuracy of source {sha[:12]}",
        )
        ctx["batches"] = sorted({b["batch_size"] for j in jobs for t in j.targets.values() for b in t.benchmark})
        if not ids:
            ids = [j.id for j in jobs[:6]]
    table: list[JobPublic] = []
    for job_id in ids:
        try:
            table.append(next((j for j in jobs if j.id == job_id), None) or load_job(request, job_id))
        except NotFound:
            continue
    ctx["table"] = _side_by_side(table, diff)
    ctx["table_jobs"] = table
    ctx["ids"] = ",".join(j.id for j in table)
    if not sha:
        recent, _ = state.jobs.list_jobs(limit=50, with_steps=False)
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
    ctx = await run_in_threadpool(_compare_context, request)
    return render(request, "compare.html", who, nav="compare", **ctx)


def _engines_context(request: Request) -> dict[str, Any]:
    state = request.app.state
    now = datetime.now(UTC)
    live = state.jobs.live_workers(state.worker_max_age)
    queued = state.jobs.queued_steps_by_queue()
    rows = []
    for name in ENGINES:
        serving = [w for w in live if name in w.engines]
        rows.append(
            {
                "name": name,
                "queue": queue_name(name),
                "workers": serving,
                "versions": next((w.versions.get(name, {}) for w in serving), {}),
                "queued": queued.get(queue_name(name), 0),
            }
        )
    extra_queues = {q: n for q, n in queued.items() if q not in {r["queue"] for r in rows}}
    return {
        "engines": rows,
        "extra_queues": extra_queues,
        "workers": [{"w": w, "age": (now - w.heartbeat_at).total_seconds()} for w in live],
        "checks": readiness_checks(state),
    }


@router.get("/engines")
async def engines_page(request: Request) -> Response:
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    ctx = await run_in_threadpool(_engines_context, request)
    template = "_engines_live.html" if request.headers.get("hx-request") else "engines.html"
    return render(request, template, who, nav="engines", **ctx)


def version_size(repo: Any, name: str, version: int) -> int | None:
    """Return the bytes of a published version in a local repository (None elsewhere: S3 is not walked)."""
    from services.repository.local import LocalModelRepository

    if not isinstance(repo, LocalModelRepository):
        return None
    return sum(p.stat().st_size for p in (repo.root / name / str(version)).rglob("*") if p.is_file())


def _repository_context(request: Request) -> dict[str, Any]:
    repo = request.app.state.repository
    listing = repository_listing(ANONYMOUS, repo)
    sizes = {(m.name, v.version): version_size(repo, m.name, v.version) for m in listing.models for v in m.versions}
    return {"listing": listing, "sizes": sizes}


@router.get("/repository")
async def repository_page(request: Request) -> Response:
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    ctx = await run_in_threadpool(_repository_context, request)
    return render(request, "repository.html", who, nav="repository", **ctx)


def _version_context(request: Request, name: str, version: int) -> dict[str, Any]:
    repo = request.app.state.repository
    if name not in repo.model_names() or version not in repo.versions(name):
        raise NotFound(f"no version {version} of model {name!r}", hint="The repository page lists what is there.")
    raw = repo.read_file(f"{name}/{version}/{MANIFEST}")
    manifest: dict[str, Any] = json.loads(raw) if raw else {}
    config = repo.read_file(f"{name}/config.pbtxt")
    return {
        "name": name,
        "version": version,
        "uri": repo.uri(f"{name}/{version}"),
        "manifest": manifest,
        "manifest_json": json.dumps(manifest, indent=2, default=str),
        "config": config.decode(errors="replace") if config else None,
        "size": version_size(repo, name, version),
    }


@router.get("/repository/{name}/{version}")
async def version_page(request: Request, name: str, version: str) -> Response:
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    try:
        if not version.isdigit():
            raise NotFound(f"no version {version!r} of model {name!r}", hint="Versions are numbers.")
        ctx = await run_in_threadpool(_version_context, request, name, int(version))
    except KilnError as exc:
        return error_page(request, who, exc)
    return render(request, "version.html", who, nav="repository", **ctx)


@router.get("")
async def ui_root() -> Response:
    return RedirectResponse("/ui/", status_code=307)
