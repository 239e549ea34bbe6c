"""Property-based requests from the OpenAPI document (schemathesis): no server error, and every
status code, content type and body the API answers is the one its document declares.

Examples are bounded (``max_examples`` per operation, derandomised) so the module stays a
regular part of the suite; schemathesis and hypothesis are pinned in constraints.txt.

The event stream (``GET /jobs/{id}/events``) is checked event by event: schemathesis reads
each Server-Sent Event and validates it against the document's ``itemSchema``, and its
``data`` (JSON) against ``JobEventPublic``. Generated cases only reach it with made-up job ids
(404), so a second test drives jobs through the job store's own code paths until every event
type it records has happened, and streams those. What schemathesis cannot check there: the
``retry:`` line and keep-alive comments, which carry no data and so are no events (the SSE
format drops them before any schema applies), and the stream's end, since it reads at most
``max_stream_events`` events or until its request timeout.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, get_args
from unittest.mock import ANY

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from jobs_support import redis_url
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup
from schemathesis.openapi.checks import JsonSchemaError
from sqlalchemy import update

from api.app import create_app
from api.events import EVENT_MODELS
from services.errors import Cancelled, EngineUnavailable
from services.formats import Format
from services.graph.planner import plan_routes
from services.jobs.db import database_url
from services.jobs.migrate import upgrade
from services.jobs.models import FINAL_JOB_STATES, JOB_EVENT_TYPES, JobStep
from services.jobs.store import JobStore, NewJob
from services.jobs.webhooks import NewWebhook
from services.settings import Settings
from services.spec import load_spec
from workers.app import create_celery_app
from workers.queues import queue_engines

MAX_EXAMPLES = 50


def _settings() -> Settings:
    root = Path(tempfile.mkdtemp(prefix="kiln-schemathesis-"))
    return Settings(
        cache_dir=root / "cache",
        data_dir=root / "data",  # built at import, before conftest points KILN_DATA_DIR away from the home
        repository=str(root / "repo"),
        artifact_store=str(root / "store"),
        broker_url=redis_url(14),
    )


def _app(s: Settings) -> Any:
    return create_app(s, create_celery_app(s))


APP = _app(_settings())
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
# Valid requests and invalid ones (wrong types, out of range, missing fields) alike.
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_the_api_answers_only_what_its_openapi_document_declares(case: schemathesis.Case) -> None:
    # A submission for an engine with no live worker is refused (503 ENGINE_UNAVAILABLE): a
    # worker's heartbeat, refreshed for every case, lets valid jobs through to the rest of the API.
    APP.state.workers.worker_heartbeat(  # type: ignore[attr-defined]
        "schemathesis", engines=queue_engines(), versions={}, pid=os.getpid(), concurrency=1
    )
    case.call_and_validate(checks=CHECKS)


# --- the event stream, every event type ------------------------------------------------------

_CONVERSION_FAILED = {
    "code": "CONVERSION_FAILED",
    "message": "No conversion rule found for operations: Det-17",
    "hint": "The step's tool failed; its output tail is in the details.",
    "details": {"step": "optimize/onnx-to-openvino-ir", "tool": "openvino.convert_model"},
}


def _submit(app: Any, targets: list[str], notify: list[str] | None = None) -> str:
    spec = load_spec({"targets": targets})
    name = f"events-{uuid.uuid4().hex[:8]}"
    new = NewJob(
        name=name,
        spec=spec.model_dump(mode="json"),
        plan=plan_routes(Format.ONNX, spec, default_name=name),
        source_key="sources/abc",
        source_sha256="ab" * 32,
        source_filename="cnn.onnx",
        source_format="onnx",
        source_seen="onnx (opset 17)",
        webhook=NewWebhook(url="https://hooks.example.com/kiln?token=t", events=notify, secret="s" * 32)
        if notify
        else None,
    )
    app.state.jobs.submit_job(new)
    return new.id


def _run_queued(app: Any, job_id: str, fail: str | None = None) -> None:
    """Claim and finish the job's queued steps as a worker would, until the job ends (``fail`` fails)."""
    steps = app.state.steps
    while (job := app.state.jobs.get_job(job_id)).status not in FINAL_JOB_STATES:
        queued = [s.step_id for s in job.steps if s.status == "queued"]
        assert queued, f"job {job_id} is {job.status} with no queued step"
        for step_id in queued:
            claim = steps.claim_step(job_id, step_id, "worker-1", stale_after=60)
            assert claim is not None, step_id
            failed = step_id == fail
            steps.finish_step(
                job_id,
                step_id,
                claim.attempt,
                status="failed" if failed else "succeeded",
                seconds=0.25,
                artifact_key=None if failed else f"steps/{job_id}/{step_id}",
                meta=None if failed else {"parity": {"passed": True}},
                error=_CONVERSION_FAILED if failed else None,
            )


def _jobs_with_every_event(app: Any) -> list[str]:
    """Return jobs whose events, together, are every type the job store records (each by its own code path)."""
    jobs, steps, hooks = app.state.jobs, app.state.steps, app.state.webhooks
    # Succeeded: a lost queue message, a worker that hands a step back, progress, a failed route
    # whose target the next route builds.
    ok = _submit(app, ["onnxruntime", "openvino"])
    with steps.db.write() as s:
        s.execute(
            update(JobStep)
            .where(JobStep.job_id == ok, JobStep.step_id == "reference")
            .values(queued_at=JobStore.now() - timedelta(seconds=1000))
        )
    assert (ok, "reference", "onnxruntime") in steps.requeue_stale(stale_after=60, lost_after=600)
    claim = steps.claim_step(ok, "reference", "worker-1", stale_after=60)
    assert steps.heartbeat(ok, "reference", claim.attempt, progress=["reading the model"]) == (True, False)
    assert steps.release_step(ok, "reference", claim.attempt, "transient error in the worker")
    _run_queued(app, ok, fail="optimize/onnx-to-openvino-ir")
    # Cancelled while a step runs (its worker reports after the job's end), then a webhook
    # that fails once and is delivered.
    cancelled = _submit(app, ["onnxruntime"], notify=["cancelled"])
    claim = steps.claim_step(cancelled, "reference", "worker-1", stale_after=60)
    assert jobs.cancel_job(cancelled)
    stopped = Cancelled(f"job {cancelled} was cancelled").to_dict()
    steps.finish_step(cancelled, "reference", claim.attempt, status="cancelled", seconds=0.1, error=stopped)
    hooks.failed(hooks.claim(cancelled), "HTTP 502 from the receiver", retry_in=0.0)
    hooks.delivered(hooks.claim(cancelled), 204)
    # Failed before any step ran, with a webhook that gives up.
    failed = _submit(app, ["onnxruntime"], notify=["failed"])
    jobs.fail_job(failed, EngineUnavailable("no worker serves onnxruntime", engine="onnxruntime"))
    hooks.failed(hooks.claim(failed), "connection refused", retry_in=None)
    return [ok, cancelled, failed]


def _stream_cases(schema: Any, app: Any, job_id: str) -> list[Any]:
    """Return the cases reading the job's stream: from the start, and resumed after its `finished` event."""
    events = schema["/jobs/{job_id}/events"]["GET"]
    finished = next(e.id for e in app.state.jobs.events(job_id) if e.type == "finished")
    return [
        events.Case(path_parameters={"job_id": job_id}),
        events.Case(path_parameters={"job_id": job_id}, headers={"last-event-id": str(finished)}),
    ]


def _event_types(body: bytes) -> list[str]:
    return [line[len("event: ") :] for line in body.decode().splitlines() if line.startswith("event: ")]


def test_every_event_type_has_a_public_model() -> None:
    assert tuple(EVENT_MODELS) == JOB_EVENT_TYPES
    for kind, model in EVENT_MODELS.items():
        assert get_args(model.model_fields["type"].annotation) == (kind,), model


def test_every_job_event_streams_as_the_openapi_document_declares() -> None:
    s = _settings()
    upgrade(database_url(s))  # the app's lifespan would; it starts only with the first request
    app = _app(s)
    # Every event is recorded before the first request starts the app's webhook sender, which
    # would otherwise race this test for the deliveries.
    job_ids = _jobs_with_every_event(app)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    schema.config.max_stream_events = 1000  # every event of these jobs, not the first 20
    seen: list[str] = []
    for job_id in job_ids:
        for case in _stream_cases(schema, app, job_id):
            response = case.call_and_validate(checks=CHECKS)
            assert response.status_code == 200
            seen += _event_types(response.content)
    assert set(seen) == set(JOB_EVENT_TYPES), set(JOB_EVENT_TYPES) - set(seen)
    assert seen.count("finished") == len(job_ids)


def test_an_event_that_breaks_its_schema_is_caught() -> None:
    """The check above can fail: a `progress` event without its message is a schema violation."""
    s = _settings()
    upgrade(database_url(s))
    app = _app(s)
    job_id = _submit(app, ["onnxruntime"])
    with app.state.jobs.db.write() as session:
        app.state.jobs.db.add_event(session, job_id, "progress", "reference")
    app.state.jobs.cancel_job(job_id)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    case = schema["/jobs/{job_id}/events"]["GET"].Case(path_parameters={"job_id": job_id})
    with pytest.raises(FailureGroup) as caught:
        case.call_and_validate(checks=CHECKS)
    [failure] = caught.value.exceptions
    assert isinstance(failure, JsonSchemaError) and failure.title == "SSE event payload violates content schema"
    assert failure.instance == {"at": ANY, "step": "reference", "type": "progress"}
