"""The events of ``GET /jobs/{id}/events``: one public model per event type, and the stream's OpenAPI entry.

Each Server-Sent Event carries ``id`` (the event's id, for ``Last-Event-ID``), ``event`` (its
type) and ``data``: a JSON object with ``type``, ``step``, ``at`` and the fields of its type,
exactly as :func:`api.routes.jobs._sse` writes them from the job store's records. The
document describes the stream the OpenAPI 3.2 way FastAPI also uses (an ``itemSchema`` per
event whose ``data`` has ``contentMediaType: application/json`` and a ``contentSchema``), so
schemathesis validates every event's payload and a generated client gets a model per type.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter

from api.schemas import ErrorPublic
from services.jobs.models import JOB_EVENT_TYPES

__all__ = [
    "EVENT_MODELS",
    "JobEventPublic",
    "event_stream_content",
    "event_stream_schemas",
]

_STREAM_DESCRIPTION = """\
One Server-Sent Event. The stream starts with `retry: 2000` (no data, so no event), sends
a `: keep-alive` comment after 15 s without events, and ends after the `finished` event (at
once for a job that had already finished, unless `Last-Event-ID` asks for what came after it:
a webhook's delivery is recorded after `finished`). `data` is one line of JSON: a
JobEventPublic of the type `event` names."""


class _Event(BaseModel):
    step: str | None = Field(description="The plan step the event is about; null for the job as a whole.")
    at: datetime = Field(description="When the event was recorded (UTC).")


class JobSubmittedEvent(_Event):
    """The upload was accepted and the job recorded."""

    type: Literal["submitted"]
    filename: str = Field(description="The model's file name as stored.")
    sha256: str = Field(description="The model file's SHA-256.")


class JobPlannedEvent(_Event):
    """The job's plan: the route per target and its steps (the same as GET /jobs/{id}'s `plan`)."""

    type: Literal["planned"]
    plan: dict[str, Any]
    source: str = Field(description="What format detection saw in the upload.")


class StepQueuedEvent(_Event):
    """A step's inputs are ready: it waits on its engine's queue."""

    type: Literal["step_queued"]
    queue: str


class StepStartedEvent(_Event):
    """A worker claimed the step and runs it."""

    type: Literal["step_started"]
    kind: str = Field(description="The step's kind: reference, optimize, convert, export, publish...")
    engine: str
    worker: str = Field(description="The worker that runs it.")
    attempt: int = Field(description="1 for the first run; more after a worker loss.")


class ProgressEvent(_Event):
    """A line of progress a running step reported."""

    type: Literal["progress"]
    message: str
    tune: dict[str, Any] | None = Field(
        default=None,
        description="A tune job's step (POST /tune): what the line reports as data (`type`: tune_build, "
        "tune_built, tune_measure, tune_candidates, tune_recommendation...), so pages can draw candidates as they arrive.",
    )


class StepFinishedEvent(_Event):
    """The step succeeded."""

    type: Literal["step_finished"]
    seconds: float
    cached: bool = Field(description="Its output came from the cache.")


class StepFailedEvent(_Event):
    """The step failed: its error (code, message, hint, a sanitised excerpt of the tool's output)."""

    type: Literal["step_failed"]
    error: ErrorPublic


class StepCancelledEvent(_Event):
    """A running step stopped because its job was cancelled."""

    type: Literal["step_cancelled"]


class StepSkippedEvent(_Event):
    """The step will not run: a step it needs failed."""

    type: Literal["step_skipped"]
    because: str | None = Field(description="The error code of the failure it depends on.")


class StepRequeuedEvent(_Event):
    """A claimed step went back to its queue (its worker stopped heartbeating, or a transient error)."""

    type: Literal["step_requeued"]
    reason: str


class StepReannouncedEvent(_Event):
    """A step queued for long was announced on its queue again (its message may have been lost)."""

    type: Literal["step_reannounced"]


class RouteFailedEvent(_Event):
    """A target's route failed at `step`; the next route takes over, or the target fails (`next_route` null)."""

    type: Literal["route_failed"]
    target: str
    rank: int = Field(description="The failed route's rank: 1 is the first choice.")
    route: str
    status: str = Field(description="The failed route's status.")
    tool: str | None = Field(default=None, description="The tool that failed, when known.")
    code: str | None = Field(default=None, description="The failure's error code, when known.")
    error: str | None = Field(description="The failed step's error message.")
    next_route: str | None = Field(description="The route tried next; null when none is left.")
    message: str = Field(description="The line the job log shows.")


class JobFailedEvent(_Event):
    """The job could not go on (e.g. its first steps could not be queued)."""

    type: Literal["failed"]
    error: ErrorPublic


class JobCancelledEvent(_Event):
    """The job was cancelled."""

    type: Literal["cancelled"]


class JobFinishedEvent(_Event):
    """The job ended: the stream's last event."""

    type: Literal["finished"]
    status: Literal["succeeded", "failed", "cancelled"]
    ok: bool = Field(description="Every target succeeded.")
    cached: bool | None = Field(
        default=None, description="Every step came from the cache; absent when the job ended before its steps ran."
    )


class WebhookDeliveredEvent(_Event):
    """The job's webhook was delivered (recorded after `finished`)."""

    type: Literal["webhook_delivered"]
    url: str = Field(description="The receiver's origin (scheme, host, port).")
    event: str = Field(description="The job state the webhook reported.")
    status: int = Field(description="The receiver's HTTP status.")
    attempt: int


class WebhookFailedEvent(_Event):
    """A webhook delivery failed; it is retried in `retry_in` seconds."""

    type: Literal["webhook_failed"]
    url: str = Field(description="The receiver's origin (scheme, host, port).")
    event: str = Field(description="The job state the webhook reports.")
    attempt: int
    message: str
    retry_in: float


class WebhookGaveUpEvent(_Event):
    """A webhook's last delivery attempt failed; it is not retried."""

    type: Literal["webhook_gave_up"]
    url: str = Field(description="The receiver's origin (scheme, host, port).")
    event: str = Field(description="The job state the webhook reported.")
    attempt: int
    message: str


#: The public model of each event type, in the order of services.jobs.models.JobEventType
#: (tests/test_api_schemathesis.py checks that every type has one).
EVENT_MODELS: dict[str, type[_Event]] = {
    "submitted": JobSubmittedEvent,
    "planned": JobPlannedEvent,
    "step_queued": StepQueuedEvent,
    "step_started": StepStartedEvent,
    "progress": ProgressEvent,
    "step_finished": StepFinishedEvent,
    "step_failed": StepFailedEvent,
    "step_cancelled": StepCancelledEvent,
    "step_skipped": StepSkippedEvent,
    "step_requeued": StepRequeuedEvent,
    "step_reannounced": StepReannouncedEvent,
    "route_failed": RouteFailedEvent,
    "failed": JobFailedEvent,
    "cancelled": JobCancelledEvent,
    "finished": JobFinishedEvent,
    "webhook_delivered": WebhookDeliveredEvent,
    "webhook_failed": WebhookFailedEvent,
    "webhook_gave_up": WebhookGaveUpEvent,
}

JobEventPublic = Annotated[
    JobSubmittedEvent
    | JobPlannedEvent
    | StepQueuedEvent
    | StepStartedEvent
    | ProgressEvent
    | StepFinishedEvent
    | StepFailedEvent
    | StepCancelledEvent
    | StepSkippedEvent
    | StepRequeuedEvent
    | StepReannouncedEvent
    | RouteFailedEvent
    | JobFailedEvent
    | JobCancelledEvent
    | JobFinishedEvent
    | WebhookDeliveredEvent
    | WebhookFailedEvent
    | WebhookGaveUpEvent,
    Field(discriminator="type"),
]

_REF = "#/components/schemas/{model}"


def event_stream_schemas() -> dict[str, Any]:
    """Return the components the stream refers to: ``JobEventPublic`` (a union on ``type``) and each event's model."""
    schema = TypeAdapter(JobEventPublic).json_schema(ref_template=_REF, mode="serialization")
    found: dict[str, Any] = schema.pop("$defs")
    found["JobEventPublic"] = {
        "title": "JobEventPublic",
        "description": "The `data` of one event of GET /jobs/{id}/events: `type` says which fields come with it.",
        **schema,
    }
    return found


def event_stream_content() -> dict[str, Any]:
    """Return the 200 answer's ``content``: ``text/event-stream`` with the schema of each event."""
    item = {
        "type": "object",
        "description": _STREAM_DESCRIPTION,
        "required": ["id", "event", "data"],
        "properties": {
            "id": {
                "type": "string",
                "pattern": "^[0-9]+$",
                "description": "The event's id: send it as `Last-Event-ID` to resume after it.",
            },
            "event": {"type": "string", "enum": list(JOB_EVENT_TYPES), "description": "The event's type."},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"$ref": _REF.format(model="JobEventPublic")},
            },
            "retry": {"type": "integer", "minimum": 0, "description": "Milliseconds to wait before reconnecting."},
        },
    }
    return {"text/event-stream": {"itemSchema": item}}
