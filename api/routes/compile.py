"""POST /compile: stream the upload to disk, accept the job, answer 202 with where to follow it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from api.deps import Intake, IntakeDep
from api.idempotency import ACCEPTED_RESPONSE, IDEMPOTENCY_RESPONSES, IdempotencyKeyHeader, replay, upload_fingerprint
from api.schemas import ErrorPublic, JobAccepted
from api.submission import Planner, submit_job
from api.upload import Upload, receive_upload
from services.jobs.idempotency import IdempotencyClaim, KeyTaken
from services.jobs.quotas import QUOTA_DESCRIPTION, TenantQuota

router = APIRouter(tags=["jobs"])

ERRORS: dict[int | str, dict[str, Any]] = {
    **ACCEPTED_RESPONSE,
    **IDEMPOTENCY_RESPONSES,
    400: {
        "model": ErrorPublic,
        "description": "SOURCE_UNREADABLE, UNSAFE_INPUT (archive with .., absolute paths, links, a bomb)",
    },
    401: {"model": ErrorPublic, "description": "UNAUTHORIZED"},
    403: {
        "model": ErrorPublic,
        "description": "FORBIDDEN (a read token; a model name of another tenant; a serving.root other than the "
        "deployment's, from a tenant's token; a cross-site browser request)",
    },
    413: {"model": ErrorPublic, "description": "UPLOAD_TOO_LARGE"},
    415: {"model": ErrorPublic, "description": "UNSUPPORTED_FORMAT"},
    422: {"model": ErrorPublic, "description": "INVALID_SPEC (naming the field), NO_ROUTE"},
    429: {"model": ErrorPublic, "description": QUOTA_DESCRIPTION},
    503: {
        "model": ErrorPublic,
        "description": "SERVICE_UNAVAILABLE (broker down), ENGINE_UNAVAILABLE (an engine the job needs has no "
        "live worker and the spec does not set wait_for_workers; under `kiln serve` an engine whose own worker "
        "is still starting is not refused: the job waits)",
    },
}

_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                # The component this becomes (api/openapi.py), so generated clients name it.
                "title": "JobCreate",
                "description": "A model and its CompileSpec (and int8 calibration data, labelled evaluation data).",
                "type": "object",
                "required": ["model", "spec"],
                "properties": {
                    "model": {
                        "type": "string",
                        "format": "binary",
                        "description": "The model: a single file or an archive (.zip, .tar, .tar.gz).",
                    },
                    "spec": {"$ref": "#/components/schemas/CompileSpec"},
                    "calibration": {
                        "type": "string",
                        "format": "binary",
                        "description": "Optional .npz of real inputs (int8 calibration and parity inputs): "
                        "arrays keyed by input name, samples stacked on axis 0, or whole feeds keyed "
                        "`<sample>/<input>` (any shapes: scalars, a state batched on another axis).",
                    },
                    "evaluation": {
                        "type": "string",
                        "format": "binary",
                        "description": "The .npz the spec's `evaluation` scores the source and every artifact on: "
                        "the inputs as in `calibration` plus `labels` (or `<sample>/labels`). A target that loses "
                        "more than evaluation.max_drop fails with ACCURACY_DROP_EXCEEDED.",
                    },
                },
            },
            "encoding": {"spec": {"contentType": "application/json"}},
        }
    },
}


@router.post(
    "/compile",
    status_code=202,
    response_model=JobAccepted,
    responses=ERRORS,
    openapi_extra={"requestBody": _BODY},
    summary="Submit a model and a CompileSpec",
)
async def submit(
    request: Request,
    intake: IntakeDep,
    idempotency_key: IdempotencyKeyHeader = None,
    cache: bool = Query(True, description="Take step outputs from the cache when present."),
) -> JSONResponse:
    """Stream the upload to the artifact store, plan it and queue it for the caller's tenant; 202 with the job id.

    A `name` (or `<name>-<target>`) another tenant publishes under is FORBIDDEN. With an
    `Idempotency-Key`, a repeat of the same request answers 200 with the first job.
    """
    return await accept_upload(request, intake, idempotency_key, cache)


async def accept_upload(
    request: Request,
    intake: Intake,
    idempotency_key: str | None,
    cache: bool,
    *,
    route: str = "compile",
    prepare: Callable[[Upload, set[str] | None], Planner] | None = None,
) -> JSONResponse:
    """Receive the upload, then detect, plan, store, record and enqueue it; 202 with the job (POST /compile, /tune).

    ``route`` keeps the two routes' idempotency fingerprints apart; ``prepare`` plans a job
    other than a compile (api/submission.py).
    """
    principal, jobs, keys = intake.principal, intake.jobs, intake.keys
    scratch = request.app.state.scratch.dir
    upload = await receive_upload(request, max_bytes=intake.settings.max_upload_bytes, tmp_root=scratch / "uploads")
    request.app.state.metrics.upload_bytes.inc(upload.total_bytes)
    claim = None
    if idempotency_key is not None:
        claim = IdempotencyClaim(principal.tenant, idempotency_key, upload_fingerprint(upload, cache, route))
        known = await run_in_threadpool(keys.find, claim.tenant, claim.key)
        if known is not None:
            upload.cleanup()
            return await replay(jobs, known, claim)
    # One trip to a worker thread for the blocking part: detect, plan, store, record, enqueue.
    try:
        job_id = await run_in_threadpool(
            submit_job,
            upload,
            jobs=jobs,
            workers=intake.workers,
            store=intake.store,
            registry=intake.registry,
            celery_app=intake.celery,
            use_cache=cache,
            principal=principal,
            scratch_root=scratch / "detect",
            worker_max_age=request.app.state.worker_max_age,
            vet=intake.settings.vet_uploads,
            idempotency=claim,
            embedded=request.app.state.embedded,
            webhooks=request.app.state.webhook_policy,
            prepare=prepare,
            repository=request.app.state.repository,
            quota=TenantQuota.of(intake.settings, principal.max_running_jobs, principal.max_queued_jobs),
        )
    except KeyTaken as taken:  # a repeat that raced the first attempt: that one recorded the job
        assert claim is not None
        return await replay(jobs, taken.known, claim)
    request.app.state.metrics.jobs_submitted.inc()
    url = f"/jobs/{job_id}"
    body = JobAccepted(id=job_id, url=url, events_url=f"{url}/events")
    return JSONResponse(body.model_dump(), status_code=202, headers={"Location": url})
