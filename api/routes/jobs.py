"""Jobs: list, read, cancel, progress events (SSE), logs, and artifact downloads.

Every route sees only the caller's tenant's jobs (an admin's: every tenant's); another
tenant's job is NOT_FOUND, exactly like one that does not exist, so ids reveal nothing.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tarfile
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from api.deps import CeleryDep, IdempotencyDep, JobStoreDep, ReadAuth, RegistryDep, StoreDep, WriteAuth
from api.events import event_stream_content
from api.idempotency import ACCEPTED_RESPONSE, IDEMPOTENCY_RESPONSES, IdempotencyKeyHeader, replay, resubmit_fingerprint
from api.openapi import response_header
from api.polling import CachedBody, JobBodies, JobVersions
from api.schemas import ErrorPublic, JobAccepted, JobPublic, JobSort, JobsPublic, JobStatus, ResubmitRequest
from api.submission import resubmit
from api.views import job_public
from services.artifacts import DESCRIPTOR
from services.errors import NotFound
from services.graph.planner import Plan
from services.jobs.idempotency import IdempotencyClaim, KeyTaken
from services.jobs.models import FINAL_JOB_STATES, OPEN_STEP_STATES, JobEvent
from services.jobs.quotas import QUOTA_DESCRIPTION, TenantQuota
from services.jobs.store import JobFilter, JobStore
from services.pipeline.fallback import routing
from services.public_errors import public_error
from services.spec import Precision, TargetName

router = APIRouter(prefix="/jobs", tags=["jobs"])

_404: dict[int | str, dict[str, Any]] = {404: {"model": ErrorPublic, "description": "NOT_FOUND"}}
#: Seconds between polls of a job's version by an open SSE stream, and between keep-alives.
SSE_POLL = 0.05
SSE_KEEPALIVE = 15.0
#: The largest integer a query may carry: SQLite and PostgreSQL (bigint) take no more, and a
#: larger one raised OverflowError in the driver (a 500) instead of a 422 naming the field.
MAX_SQL_INT = 2**63 - 1


@router.get("", response_model=JobsPublic, summary="List jobs")
def list_jobs(
    principal: ReadAuth,
    jobs: JobStoreDep,
    store: StoreDep,
    status: JobStatus | None = None,
    tenant: str | None = Query(
        None, max_length=64, description="Only jobs of this tenant (admin tokens; any other sees its own only)."
    ),
    name: str | None = Query(None, description="Only jobs publishing this model name."),
    target: Annotated[TargetName | None, Query(description="Only jobs with this target.")] = None,
    engine: str | None = Query(None, description="Only jobs with a step on this engine."),
    precision: Annotated[Precision | None, Query(description="Only jobs at this precision.")] = None,
    source_sha256: str | None = Query(
        None, pattern=r"^[0-9a-fA-F]{4,64}$", description="Only jobs of this source model (a prefix is enough)."
    ),
    created_after: Annotated[datetime | None, Query(description="Only jobs created at or after this time.")] = None,
    created_before: Annotated[datetime | None, Query(description="Only jobs created before this time.")] = None,
    sort: Annotated[JobSort, Query(description="Order: a column, `-` first for descending.")] = "-created_at",
    limit: int = Query(50, ge=1, le=500),
    offset: int = Query(0, ge=0, le=MAX_SQL_INT),
) -> JobsPublic:
    """Return one page of the caller's tenant's jobs, newest first unless `sort` says otherwise."""
    own = principal.tenant_filter
    if own is not None and tenant not in (None, own):
        return JobsPublic(data=[], count=0)  # another tenant's: none of them are visible
    filters = JobFilter(
        tenant=own if own is not None else tenant,
        status=status,
        name=name,
        target=target.value if target else None,
        engine=engine,
        precision=precision.value if precision else None,
        source_sha256=source_sha256,
        created_after=created_after,
        created_before=created_before,
        sort=sort.lstrip("-"),
        ascending=not sort.startswith("-"),
    )
    rows, count = jobs.list_jobs(filters=filters, limit=limit, offset=offset)
    return JobsPublic(data=[job_public(j, store) for j in rows], count=count)


def _build_body(jobs: JobStore, store: Any, cache: JobBodies, job_id: str, version: int) -> CachedBody:
    """Serialize the job's view and cache it under ``version``, read before the job itself.

    So a body is never cached under a newer version than it shows (at worst it is rebuilt
    once more).
    """
    job = jobs.get_job(job_id)  # NOT_FOUND if it was deleted meanwhile
    # Serialized once here, not validated again by FastAPI: this is the hottest route.
    body = job_public(job, store).model_dump_json().encode()
    final = job.status in FINAL_JOB_STATES and not any(s.status in OPEN_STEP_STATES for s in job.steps)
    item = CachedBody(version, final, body, job.tenant)
    cache.put(job_id, item)
    return item


def _no_job(job_id: str) -> NotFound:
    return NotFound(f"no job {job_id}", hint="List jobs with GET /jobs.")


def _answer(item: CachedBody, if_none_match: str | None) -> Response:
    headers = {"ETag": item.etag, "Cache-Control": "no-cache"}
    if if_none_match is not None and item.etag in (t.strip() for t in if_none_match.split(",")):
        return Response(status_code=304, headers=headers)
    return Response(item.body, media_type="application/json", headers=headers)


_IF_NONE_MATCH = {
    "name": "If-None-Match",
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
    "description": "The ETag of an earlier answer: 304 Not Modified while the job has not changed.",
}


_ETAG = response_header("The job's version: send it back in If-None-Match.")


# If-None-Match is read off the request, not declared as a Header parameter: FastAPI's
# parameter machinery costs more than the rest of a cached answer. It is documented here.
@router.get(
    "/{job_id}",
    response_model=JobPublic,
    responses={
        200: {"headers": {"ETag": _ETAG}},
        304: {"description": "Not Modified (If-None-Match matched the ETag)", "headers": {"ETag": _ETAG}},
        **_404,
    },
    openapi_extra={"parameters": [_IF_NONE_MATCH]},
    summary="Read a job",
)
async def get_job(job_id: str, request: Request, principal: ReadAuth, jobs: JobStoreDep, store: StoreDep) -> Response:
    """Return the job: status, plan, steps with timings and errors, per-target parity, benchmark and artifacts.

    The `ETag` is the job's version: send it back in `If-None-Match` to get `304 Not Modified`
    while nothing changed.
    """
    state = request.app.state
    cache: JobBodies = state.job_bodies
    if_none_match = request.headers.get("if-none-match")
    item = cache.get(job_id)
    own = principal.tenant_filter
    if item is not None and item.final:
        if own is not None and item.tenant != own:
            raise _no_job(job_id)
        return _answer(item, if_none_match)
    seen = await state.job_versions.get(job_id)
    if seen is None or (own is not None and seen.tenant != own):
        raise _no_job(job_id)
    if item is None or item.version != seen.version:
        item = await run_in_threadpool(_build_body, jobs, store, cache, job_id, seen.version)
    return _answer(item, if_none_match)


@router.delete("/{job_id}", response_model=JobPublic, responses=_404, status_code=202, summary="Cancel a job")
def cancel_job(job_id: str, principal: WriteAuth, jobs: JobStoreDep, store: StoreDep) -> JobPublic:
    """Cancel: queued steps never run, a running step is stopped by its worker. A finished job is left as is."""
    jobs.cancel_job(job_id, principal.tenant_filter)
    return job_public(jobs.get_job(job_id), store)


class EventStreamResponse(StreamingResponse):
    """A stream of Server-Sent Events (so the document names text/event-stream, not JSON)."""

    media_type = "text/event-stream"


def _sse(event: JobEvent) -> str:
    body = {"type": event.type, "step": event.step, "at": event.at.isoformat(), **(event.data or {})}
    if isinstance(body.get("error"), dict):  # events recorded before the store sanitised errors
        body["error"], _ = public_error(body["error"])
    return f"id: {event.id}\nevent: {event.type}\ndata: {json.dumps(body, default=str)}\n\n"


async def _event_stream(request: Request, jobs: JobStore, job_id: str, after: int) -> Any:
    versions: JobVersions = request.app.state.job_versions
    last = after
    idle = 0.0
    yield "retry: 2000\n\n"
    while True:
        # The job's version (its newest event id) comes from the shared version rounds: any
        # number of open streams and pollers cost one query per round. Events are read only
        # when it moved.
        seen = await versions.get(job_id)
        if seen is None:
            return  # the job was deleted
        if seen.version > last:
            for ev in await run_in_threadpool(jobs.events, job_id, last):
                last = ev.id
                yield _sse(ev)
                if ev.type == "finished":
                    return
            idle = 0.0
            continue
        # A client resuming after the job's `finished` event would wait forever: end then.
        if seen.status in FINAL_JOB_STATES:
            return
        if await request.is_disconnected():
            return
        # Every stream wakes on the same ticks of the loop's clock, so the polls of all open
        # streams fall into one version round: one query per tick, however many streams.
        await asyncio.sleep(SSE_POLL - asyncio.get_running_loop().time() % SSE_POLL)
        idle += SSE_POLL
        if idle >= SSE_KEEPALIVE:
            idle = 0.0
            yield ": keep-alive\n\n"


@router.get(
    "/{job_id}/events",
    response_class=EventStreamResponse,
    responses={200: {"content": event_stream_content(), "description": "Server-Sent Events"}, **_404},
    summary="Follow a job's progress (Server-Sent Events)",
)
def job_events(
    job_id: str,
    request: Request,
    principal: ReadAuth,
    jobs: JobStoreDep,
    last_event_id: Annotated[int | None, Header(ge=0, le=MAX_SQL_INT)] = None,
) -> EventStreamResponse:
    """Stream the job's events (planned, step_started, progress, step_finished, ...) until `finished`.

    Reconnecting with `Last-Event-ID` resumes after that event.
    """
    jobs.job_status(job_id, principal.tenant_filter)  # 404 before the stream starts
    return EventStreamResponse(
        _event_stream(request, jobs, job_id, last_event_id or 0),
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get(
    "/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={
        200: {
            "content": {"text/plain": {}},
            "headers": {
                "X-Log-Lines": response_header("How many lines the whole log has.", "integer"),
                "X-Log-Offset": response_header("The line the answer starts at.", "integer"),
            },
        },
        **_404,
    },
    summary="A job's log",
)
def job_logs(
    job_id: str,
    principal: ReadAuth,
    jobs: JobStoreDep,
    tail: int | None = Query(None, ge=1, le=100_000, description="Only the last N lines."),
    offset: int = Query(
        0, ge=0, le=MAX_SQL_INT, description="Skip the first N lines (to follow a log: the lines seen so far)."
    ),
    limit: int | None = Query(None, ge=1, le=100_000, description="At most N lines from `offset`."),
) -> PlainTextResponse:
    """Return the job's events as lines, then each step's captured tool output.

    `X-Log-Lines` says how many lines the whole log has and `X-Log-Offset` where the answer
    starts, so a viewer shows the tail of a huge log and follows it with `offset`.
    """
    lines = job_log_lines(jobs, job_id, principal.tenant_filter)
    start = max(len(lines) - tail, offset) if tail is not None else min(offset, len(lines))
    end = len(lines) if limit is None else min(len(lines), start + limit)
    body = "".join(line + "\n" for line in lines[start:end])
    return PlainTextResponse(body, headers={"X-Log-Lines": str(len(lines)), "X-Log-Offset": str(start)})


def job_log_lines(jobs: JobStore, job_id: str, tenant: str | None) -> list[str]:
    """Return the job's log as lines: its events, then each step's captured tool output (NOT_FOUND for another tenant's)."""
    job = jobs.get_job(job_id, tenant)
    lines = [f"job {job.id} ({job.name}): {job.status}"]
    after = 0
    while True:
        batch = jobs.events(job_id, after, limit=1000)
        for ev in batch:
            data = dict(ev.data or {})
            data.pop("plan", None)  # the plan is in GET /jobs/{id}; keep the log readable
            detail = data.pop("message", None) or (json.dumps(data, default=str) if data else "")
            lines.append(f"{ev.at.isoformat()} {ev.type:<14} {ev.step or '-':<32} {detail}")
        if len(batch) < 1000:
            break
        after = batch[-1].id
    for step in job.steps:
        if step.log:
            lines.append("")
            lines.append(f"--- output of {step.step_id} (attempt {step.attempt}, {step.worker}) ---")
            lines.extend(step.log.rstrip().split("\n"))
    return lines


@router.post(
    "/{job_id}/resubmit",
    status_code=202,
    response_model=JobAccepted,
    responses={
        **ACCEPTED_RESPONSE,
        **_404,
        **IDEMPOTENCY_RESPONSES,
        403: {"model": ErrorPublic, "description": "FORBIDDEN (a serving.root other than the deployment's)"},
        422: {"model": ErrorPublic, "description": "INVALID_SPEC, NO_ROUTE"},
        429: {"model": ErrorPublic, "description": QUOTA_DESCRIPTION},
    },
    summary="Submit a job again: same source, same or edited spec",
)
async def resubmit_job(
    job_id: str,
    request: Request,
    principal: WriteAuth,
    jobs: JobStoreDep,
    store: StoreDep,
    celery: CeleryDep,
    registry: RegistryDep,
    keys: IdempotencyDep,
    idempotency_key: IdempotencyKeyHeader = None,
    body: ResubmitRequest | None = None,
) -> JSONResponse:
    """Queue a new job on the stored source (and calibration) of `job_id`, with its spec or `spec` from the body.

    Nothing is uploaded again, and steps whose inputs are unchanged come from the cache. With
    an `Idempotency-Key`, a repeat of the same request answers 200 with the first new job.
    """
    spec = body.spec if body is not None else None
    claim = None
    if idempotency_key is not None:
        claim = IdempotencyClaim(principal.tenant, idempotency_key, resubmit_fingerprint(job_id, spec))
        known = await run_in_threadpool(keys.find, claim.tenant, claim.key)
        if known is not None:
            return await replay(jobs, known, claim)
    try:
        new_id = await run_in_threadpool(
            resubmit,
            jobs,
            store,
            registry,
            celery,
            job_id,
            spec,
            principal=principal,
            use_cache=True,
            idempotency=claim,
            webhooks=request.app.state.webhook_policy,
            repository=request.app.state.repository,
            quota=TenantQuota.of(request.app.state.settings, principal.max_running_jobs, principal.max_queued_jobs),
        )
    except KeyTaken as taken:  # a repeat that raced the first attempt
        assert claim is not None
        return await replay(jobs, taken.known, claim)
    request.app.state.metrics.jobs_submitted.inc()
    url = f"/jobs/{new_id}"
    accepted = JobAccepted(id=new_id, url=url, events_url=f"{url}/events")
    return JSONResponse(accepted.model_dump(), status_code=202, headers={"Location": url})


def _winning_export(job: Any, target: str) -> str:
    """Return the export step of the route that built ``target`` (the first choice while none has)."""
    plan = Plan.from_dict(job.plan)
    status = {s.step_id: s.status for s in job.steps}
    errors = {s.step_id: s.error for s in job.steps if s.error}
    r = routing(plan, status, errors)[target]
    return r.options[r.winner if r.winner is not None else 0].export


def _tar_artifact(store: Any, key: str, scratch: Path, arcname: str) -> Path:
    """Write the artifact under ``key`` as a tar in ``scratch``; return the tar's path."""
    local = store.local_path(key)
    if local is None:
        local = store.fetch_dir(key, scratch / "artifact")
    tar_path = scratch / f"{arcname}.tar"
    with tarfile.open(tar_path, "w") as tf:
        for p in sorted(Path(local).rglob("*")):
            if p.is_file() and p.name not in (DESCRIPTOR, ".kiln-complete"):
                tf.add(p, arcname=f"{arcname}/{p.relative_to(local).as_posix()}")
    return tar_path


@router.get(
    "/{job_id}/artifacts/{target}",
    response_class=FileResponse,
    responses={
        200: {
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
            "description": "The exported artifact as a tar",
            "headers": {"Content-Disposition": response_header("attachment; filename=<name>-<target>.tar")},
        },
        **_404,
    },
    summary="Download a target's artifact",
)
def download_artifact(
    job_id: str, target: str, request: Request, principal: ReadAuth, jobs: JobStoreDep, store: StoreDep
) -> FileResponse:
    """Return the exported artifact of ``target`` (the files that were published) as a tar."""
    job = jobs.get_job(job_id, principal.tenant_filter)
    targets = list(job.plan.get("routes", {}))
    if target not in targets:
        raise NotFound(f"job {job_id} has no target {target!r}", hint=f"Its targets: {', '.join(targets)}.")
    export_id = _winning_export(job, target)
    step = next((s for s in job.steps if s.step_id == export_id), None)
    if step is None or step.status != "succeeded" or not step.artifact_key:
        raise NotFound(
            f"target {target} of job {job_id} has no artifact (export step is {step.status if step else 'missing'})",
            hint="Wait for the job to finish; GET /jobs/{id} shows each step.",
        )
    meta = step.meta or {}
    if "tune" in meta and not meta.get("format"):  # a tune that recommended nothing holds only its report
        raise NotFound(
            f"the tune of job {job_id} recommended nothing: it has no artifact",
            hint="GET /jobs/{id} has its report (`tune`): why each candidate was dropped.",
        )
    root = request.app.state.scratch.dir / "downloads"
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="dl-", dir=root))
    arcname = f"{job.name}-{target}"
    tar_path = _tar_artifact(store, step.artifact_key, scratch, arcname)
    return FileResponse(
        tar_path,
        media_type="application/x-tar",
        filename=f"{arcname}.tar",
        background=BackgroundTask(shutil.rmtree, scratch, ignore_errors=True),
    )
