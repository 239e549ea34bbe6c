"""The ``Idempotency-Key`` header of POST /compile and POST /jobs/{id}/resubmit.

A submit repeated with the same key and the same request within 24 h answers 200 with the
job the first one made (``Idempotent-Replayed: true``); the same key with another request is
409 IDEMPOTENCY_KEY_REUSED. Keys are per tenant (services/jobs/idempotency.py). "The same
request" is the spec as JSON (key order aside), the model's and calibration's sha256 and file
names and the ``cache`` flag for an upload; the job and the spec for a resubmit.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import Header
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from api.openapi import response_header
from api.schemas import ErrorPublic, JobAccepted
from api.upload import Upload
from services.jobs.idempotency import IdempotencyClaim, KnownKey, fingerprint
from services.jobs.store import JobStore

__all__ = [
    "ACCEPTED_RESPONSE",
    "IDEMPOTENCY_RESPONSES",
    "IdempotencyKeyHeader",
    "replay",
    "resubmit_fingerprint",
    "upload_fingerprint",
]

IdempotencyKeyHeader = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        pattern=r"^[\x21-\x7e]+$",
        description="Makes the submit safe to repeat: the same key and the same request within 24 h answer 200 "
        "with the first job (same id) instead of making another; the same key with another request is 409 "
        "IDEMPOTENCY_KEY_REUSED. Printable ASCII, at most 255 characters, per tenant (a UUID per submit, say).",
    ),
]

_LOCATION = response_header("The job's resource: /jobs/{id}.")

#: The 202 of the routes that make a job: where to follow it.
ACCEPTED_RESPONSE: dict[int | str, dict[str, Any]] = {202: {"headers": {"Location": _LOCATION}}}

#: What the routes taking the header add to their documented answers.
IDEMPOTENCY_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": JobAccepted,
        "description": "A repeat: this Idempotency-Key and request were seen within 24 h; the job they made "
        "(header Idempotent-Replayed: true).",
        "headers": {
            "Location": _LOCATION,
            "Idempotent-Replayed": {
                "description": "Always `true`: a repeat.",
                "required": True,
                "schema": {"type": "string", "enum": ["true"]},
            },
        },
    },
    409: {
        "model": ErrorPublic,
        "description": "IDEMPOTENCY_KEY_REUSED: the Idempotency-Key was sent with another request within 24 h.",
    },
}


def _spec_value(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # refused later as INVALID_SPEC; as text it still fingerprints


def upload_fingerprint(upload: Upload, use_cache: bool, route: str = "compile") -> str:
    """Return the fingerprint of an upload: spec (and a tune's options), model and calibration (sha256 and name), cache flag."""
    files = {name: [f.sha256, f.filename] for name, f in sorted(upload.files.items())}
    extra = {"tune": _spec_value(upload.fields.get("tune"))} if route == "tune" else {}
    return fingerprint(route=route, spec=_spec_value(upload.fields.get("spec")), files=files, cache=use_cache, **extra)


def resubmit_fingerprint(job_id: str, spec: dict[str, Any] | None) -> str:
    """Return the fingerprint of a resubmission: the job and the spec (None: the job's own)."""
    return fingerprint(route="resubmit", job=job_id, spec=spec)


async def replay(jobs: JobStore, known: KnownKey, claim: IdempotencyClaim) -> JSONResponse:
    """Answer a repeated submit: 200 with the job ``known`` names, or 409 when it was another request."""
    job_id = known.answer(claim)
    status = await run_in_threadpool(jobs.job_status, job_id)
    url = f"/jobs/{job_id}"
    body = JobAccepted(id=job_id, status=status, url=url, events_url=f"{url}/events")  # type: ignore[arg-type]
    return JSONResponse(body.model_dump(), status_code=200, headers={"Location": url, "Idempotent-Replayed": "true"})
