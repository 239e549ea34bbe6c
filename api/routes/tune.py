"""POST /tune: a model and the goals of a search across engines × precisions × settings; 202 with the job.

The job is followed like a compile (GET /jobs/{id}, its events, the dashboard's job page): its
tune step reports the candidates as they are built and timed (``progress`` events with
``tune`` data), its step report holds the whole search (`kiln tune --json`'s body), and its
``tune`` target is the recommendation, published with the measured serving settings.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from api.deps import IntakeDep
from api.idempotency import IdempotencyKeyHeader
from api.routes.compile import ERRORS, accept_upload
from api.schemas import JobAccepted
from api.submission import Planner
from api.tune_submission import prepare_tune, tune_worker_engines
from api.upload import Upload

__all__ = ["router"]

router = APIRouter(tags=["jobs"])

_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "title": "TuneCreate",
                "description": "A model, the search's goals (`tune`) and the compile settings its candidates share.",
                "type": "object",
                "required": ["model"],
                "properties": {
                    "model": {
                        "type": "string",
                        "format": "binary",
                        "description": "The model: a single file or an archive (.zip, .tar, .tar.gz).",
                    },
                    "tune": {"$ref": "#/components/schemas/TuneOptions"},
                    "spec": {
                        "$ref": "#/components/schemas/CompileSpec",
                        "description": "Optional: inputs, tolerances, calibration... (targets, precision and "
                        "benchmark are the search's).",
                    },
                    "calibration": {
                        "type": "string",
                        "format": "binary",
                        "description": "Optional .npz of real inputs (int8 calibration and parity).",
                    },
                    "evaluation": {
                        "type": "string",
                        "format": "binary",
                        "description": "Optional labelled .npz for the spec's `evaluation`: an accuracy floor, a "
                        "candidate losing more than evaluation.max_drop is pruned.",
                    },
                },
            },
            "encoding": {"spec": {"contentType": "application/json"}, "tune": {"contentType": "application/json"}},
        }
    },
}


@router.post(
    "/tune",
    status_code=202,
    response_model=JobAccepted,
    responses=ERRORS,
    openapi_extra={"requestBody": _BODY},
    summary="Search engines, precisions and settings for the artifact that best meets the goals",
)
async def tune(
    request: Request,
    intake: IntakeDep,
    idempotency_key: IdempotencyKeyHeader = None,
    cache: bool = Query(
        True,
        description="Reuse an identical earlier tune's result (same model, goals and tools); false measures again.",
    ),
) -> JSONResponse:
    """Queue a tune of the uploaded model for the caller's tenant; 202 with the job id.

    The search runs on a worker that runs the searched engines together (`kiln serve`'s, or a
    worker serving several engines); it builds each target at each precision, prunes what fails
    parity, times the rest side by side under each engine's settings and recommends the best that
    meets every constraint, with the runner-up and the margin. The recommendation is published
    under the spec's `name` (default: the file's) with the tune in its manifest.
    """

    def prepare(upload: Upload, live: set[str] | None) -> Planner:
        runs = tune_worker_engines(intake.workers, request.app.state.worker_max_age)
        return prepare_tune(
            upload.fields, live_engines=live, tune_engines=runs, step_time_limit=intake.settings.step_soft_time_limit
        )

    return await accept_upload(request, intake, idempotency_key, cache, route="tune", prepare=prepare)
