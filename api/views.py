"""Turn job store rows into the public schemas (JobPublic and its parts)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from api.schemas import ErrorPublic, JobPublic, SourcePublic, StepPublic, TargetPublic
from services.graph.planner import Plan
from services.jobs.models import Job, JobStep
from services.pipeline.fallback import route_step_ids, routing
from services.public_errors import public_error
from services.storage.base import ArtifactStore

__all__ = ["job_public"]

_REPORT_KEYS = (
    "parity",
    "benchmark",
    "published",
    "passes",
    "precision",
    "format",
    "engine_details",
    "reused",
    "warnings",
    "not_needed",
)


def _error(body: dict[str, Any] | None) -> ErrorPublic | None:
    if not body:
        return None
    body, _ = public_error(body)  # errors recorded before the store sanitised them
    return ErrorPublic(
        code=body.get("code", "INTERNAL"),
        message=body.get("message", ""),
        hint=body.get("hint", ""),
        details=body.get("details"),
    )


@lru_cache(maxsize=8192)
def _cached_uri(store: ArtifactStore, key: str) -> str:
    # Keys are content addresses, so a key's URI never changes; a local store's uri() would
    # otherwise resolve the path (several syscalls) for every step of every GET.
    return store.uri(key)


def _uri(store: ArtifactStore, key: str | None) -> str | None:
    return _cached_uri(store, key) if key else None


def _step_public(row: JobStep, store: ArtifactStore) -> StepPublic:
    meta = row.meta or {}
    report = {k: meta[k] for k in _REPORT_KEYS if k in meta} or None
    return StepPublic(
        id=row.step_id,
        kind=row.kind,
        engine=row.engine,
        queue=row.queue,
        target=row.target,
        status=row.status,  # type: ignore[arg-type]
        attempt=row.attempt,
        worker=row.worker,
        cached=row.cached,
        queued_at=row.queued_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        seconds=row.seconds,
        error=_error(row.error),
        artifact_uri=_uri(store, row.artifact_key),
        report=report,
    )


def _live_target_status(chain: list[str], rows: dict[str, JobStep], job_status: str) -> str:
    states = [rows[s].status for s in chain if s in rows]
    if job_status == "cancelled":
        return "cancelled"
    if any(s in ("failed", "skipped") for s in states):
        return "failed"
    if any(s in ("running", "succeeded") for s in states):
        return "running"
    return "pending"


def _failed_evaluation(failed: JobStep | None) -> dict[str, Any] | None:
    """Return the scores an ACCURACY_DROP_EXCEEDED step recorded (a running job's failed target)."""
    details = (failed.error or {}).get("details") if failed is not None else None
    return details.get("evaluation") if isinstance(details, dict) else None


def job_public(job: Job, store: ArtifactStore) -> JobPublic:
    """Return the public view of a job loaded with its steps."""
    plan = Plan.from_dict(job.plan)
    rows = {r.step_id: r for r in job.steps}
    results: dict[str, Any] = job.result or {}
    targets: dict[str, TargetPublic] = {}
    routes = routing(
        plan, {sid: r.status for sid, r in rows.items()}, {sid: r.error for sid, r in rows.items() if r.error}
    )
    for target, r in routes.items():
        # The route that succeeded, is in progress, or was tried last; the first choice before any ran.
        index = r.winner if r.winner is not None else r.active if r.active is not None else max(len(r.tried) - 1, 0)
        option = r.options[index]
        route = option.route
        chain = route_step_ids(plan, option)
        export = rows.get(option.export)
        export_key = export.artifact_key if export is not None and export.status == "succeeded" else None
        res = results.get(target)
        if res is not None:
            status = res["status"] if job.status != "cancelled" else "cancelled"
            targets[target] = TargetPublic(
                target=target,
                route=route,
                status=status,  # type: ignore[arg-type]
                steps=chain,
                error=_error(res.get("error")) if status != "succeeded" else None,
                parity=res.get("parity"),
                evaluation=res.get("evaluation"),
                benchmark=res.get("benchmark") or [],
                warnings=res.get("warnings") or [],
                vs_fp32=res.get("vs_fp32"),
                published=res.get("published"),
                artifact_uri=_uri(store, export_key),
                download_url=f"/jobs/{job.id}/artifacts/{target}" if export_key else None,
                attempts=res.get("attempts") or [],
                device_check=res.get("device_check"),
            )
            continue
        failed = next((rows[s] for s in chain if s in rows and rows[s].status in ("failed", "skipped")), None)
        meta = (export.meta or {}) if export_key and export is not None else {}
        targets[target] = TargetPublic(
            target=target,
            route=route,
            status=_live_target_status(chain, rows, job.status),  # type: ignore[arg-type]
            steps=chain,
            error=_error(failed.error) if failed is not None else None,
            parity=meta.get("parity"),
            evaluation=meta.get("evaluation") or _failed_evaluation(failed),
            benchmark=meta.get("benchmark") or [],
            warnings=meta.get("warnings") or [],
            vs_fp32=meta.get("vs_fp32"),
            artifact_uri=_uri(store, export_key),
            download_url=f"/jobs/{job.id}/artifacts/{target}" if export_key else None,
            attempts=[a.to_dict() for a in r.tried],
            device_check=meta.get("device_check"),
        )
    server_seconds = (job.finished_at - job.created_at).total_seconds() if job.finished_at else None
    return JobPublic(
        id=job.id,
        status=job.status,  # type: ignore[arg-type]
        name=job.name,
        tenant=job.tenant,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        server_seconds=server_seconds,
        cached=job.cached,
        source=SourcePublic(
            filename=job.source_filename,
            sha256=job.source_sha256,
            format=job.source_format,
            detected_as=job.source_seen,
            size=job.source_size,
        ),
        spec=job.spec,
        plan=job.plan,
        targets=targets,
        steps=[_step_public(r, store) for r in job.steps],
        error=_error(job.error),
        kind="tune" if plan.kind == "tune" else "compile",
        tune=_tune_report(plan, rows),
    )


def _tune_report(plan: Plan, rows: dict[str, JobStep]) -> dict[str, Any] | None:
    """Return what a tune job's search step reported (None for a compile, and while it runs)."""
    if plan.kind != "tune":
        return None
    search = next((rows[s.id] for s in plan.steps if s.kind == "tune" and s.id in rows), None)
    report = (search.meta or {}).get("tune") if search is not None else None
    return report if isinstance(report, dict) else None
