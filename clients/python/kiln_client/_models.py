"""Typed results: the API's public schemas as dataclasses, field for field (``JobPublic`` is :class:`JobInfo`...).

Each ``from_dict`` takes the API's JSON and ignores fields it does not know, so a newer
server does not break an older client; ``raw`` keeps the JSON as it came.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

__all__ = [
    "ErrorInfo",
    "Event",
    "JobInfo",
    "Plan",
    "PlanStep",
    "Source",
    "Step",
    "Target",
]


def parse_time(value: Any) -> datetime | None:
    """Return the API's ISO 8601 timestamp as an aware datetime (None stays None)."""
    if not value:
        return None
    text = str(value)
    if text.endswith("Z"):  # fromisoformat takes "Z" only from Python 3.11 on
        text = text[:-1] + "+00:00"
    parsed = datetime.fromisoformat(text)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


@dataclass
class ErrorInfo:
    """An error recorded in a job, a step or a target (the API's ``ErrorPublic``)."""

    code: str
    message: str
    hint: str
    details: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, body: dict[str, Any] | None) -> ErrorInfo | None:
        if not body:
            return None
        return cls(
            code=str(body.get("code", "")),
            message=str(body.get("message", "")),
            hint=str(body.get("hint", "")),
            details=body.get("details"),
        )


@dataclass
class Source:
    """The uploaded model (``SourcePublic``)."""

    filename: str
    sha256: str
    format: str
    detected_as: str
    size: int

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Source:
        return cls(
            filename=body.get("filename", ""),
            sha256=body.get("sha256", ""),
            format=body.get("format", ""),
            detected_as=body.get("detected_as", ""),
            size=int(body.get("size") or 0),
        )


@dataclass
class Step:
    """One plan step of a job and how it ran (``StepPublic``)."""

    id: str
    kind: str
    engine: str
    queue: str
    target: str | None
    status: str
    attempt: int
    worker: str | None
    cached: bool
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    seconds: float | None
    error: ErrorInfo | None
    artifact_uri: str | None
    report: dict[str, Any] | None

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Step:
        return cls(
            id=body["id"],
            kind=body.get("kind", ""),
            engine=body.get("engine", ""),
            queue=body.get("queue", ""),
            target=body.get("target"),
            status=body.get("status", ""),
            attempt=int(body.get("attempt") or 0),
            worker=body.get("worker"),
            cached=bool(body.get("cached")),
            queued_at=parse_time(body.get("queued_at")),
            started_at=parse_time(body.get("started_at")),
            finished_at=parse_time(body.get("finished_at")),
            seconds=body.get("seconds"),
            error=ErrorInfo.from_dict(body.get("error")),
            artifact_uri=body.get("artifact_uri"),
            report=body.get("report"),
        )


@dataclass
class Target:
    """One target's outcome: route, status, parity, benchmark, artifact (``TargetPublic``)."""

    target: str
    route: str
    status: str
    steps: list[str] = field(default_factory=list)
    error: ErrorInfo | None = None
    parity: dict[str, Any] | None = None
    #: the spec's evaluation: metric, the source's and the artifact's scores, drop, max_drop, passed
    evaluation: dict[str, Any] | None = None
    benchmark: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    vs_fp32: dict[str, Any] | None = None
    published: dict[str, Any] | None = None
    artifact_uri: str | None = None
    download_url: str | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    #: a GPU-bound target: checked_on ("gpu" with the device, its parity and benchmark there, or "cpu")
    device_check: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """True when the target succeeded."""
        return self.status == "succeeded"

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Target:
        return cls(
            target=body["target"],
            route=body.get("route", ""),
            status=body.get("status", ""),
            steps=list(body.get("steps") or []),
            error=ErrorInfo.from_dict(body.get("error")),
            parity=body.get("parity"),
            evaluation=body.get("evaluation"),
            benchmark=list(body.get("benchmark") or []),
            warnings=list(body.get("warnings") or []),
            vs_fp32=body.get("vs_fp32"),
            published=body.get("published"),
            artifact_uri=body.get("artifact_uri"),
            download_url=body.get("download_url"),
            attempts=list(body.get("attempts") or []),
            device_check=body.get("device_check"),
            raw=body,
        )


@dataclass
class JobInfo:
    """A job: its spec, plan, per-step runs and per-target results (``JobPublic``).

    :class:`kiln_client.Job` adds the calls (wait, follow, download, cancel) to these fields.
    """

    id: str
    status: str
    name: str
    tenant: str
    created_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    server_seconds: float | None
    cached: bool | None
    source: Source
    spec: dict[str, Any]
    plan: dict[str, Any]
    targets: dict[str, Target]
    steps: list[Step]
    error: ErrorInfo | None = None
    #: "compile" (POST /compile) or "tune" (POST /tune).
    kind: str = "compile"
    #: A tune job's report once its search ran (``kiln tune --json``'s body: candidates, recommendation...).
    tune: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def fields_from(body: dict[str, Any]) -> dict[str, Any]:
        """Return the constructor arguments for a ``JobPublic`` JSON body."""
        return {
            "id": body["id"],
            "status": body.get("status", ""),
            "name": body.get("name", ""),
            "tenant": body.get("tenant", ""),
            "created_at": parse_time(body.get("created_at")),
            "started_at": parse_time(body.get("started_at")),
            "finished_at": parse_time(body.get("finished_at")),
            "server_seconds": body.get("server_seconds"),
            "cached": body.get("cached"),
            "source": Source.from_dict(body.get("source") or {}),
            "spec": body.get("spec") or {},
            "plan": body.get("plan") or {},
            "targets": {k: Target.from_dict(v) for k, v in (body.get("targets") or {}).items()},
            "steps": [Step.from_dict(s) for s in body.get("steps") or []],
            "error": ErrorInfo.from_dict(body.get("error")),
            "kind": body.get("kind", "compile"),
            "tune": body.get("tune"),
            "raw": body,
        }


@dataclass
class PlanStep:
    """One step a plan would run (``PlanStepPublic``)."""

    id: str
    kind: str
    engine: str
    queue: str
    inputs: dict[str, str]
    after: list[str]
    target: str | None
    tool: str
    fallback: bool = False

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> PlanStep:
        return cls(
            id=body["id"],
            kind=body.get("kind", ""),
            engine=body.get("engine", ""),
            queue=body.get("queue", ""),
            inputs=dict(body.get("inputs") or {}),
            after=list(body.get("after") or []),
            target=body.get("target"),
            tool=body.get("tool", ""),
            fallback=bool(body.get("fallback")),
        )


@dataclass
class Plan:
    """The route per target and the queues its steps would take (``PlanPublic``, the answer to POST /plan)."""

    source_format: str
    routes: dict[str, str]
    shared_steps: list[str]
    steps: list[PlanStep]
    fallback_routes: dict[str, list[str]]
    queues: list[str]
    engines_without_workers: list[str]
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Plan:
        return cls(
            source_format=body.get("source_format", ""),
            routes=dict(body.get("routes") or {}),
            shared_steps=list(body.get("shared_steps") or []),
            steps=[PlanStep.from_dict(s) for s in body.get("steps") or []],
            fallback_routes={k: list(v) for k, v in (body.get("fallback_routes") or {}).items()},
            queues=list(body.get("queues") or []),
            engines_without_workers=list(body.get("engines_without_workers") or []),
            raw=body,
        )


@dataclass
class Event:
    """One Server-Sent Event of ``GET /jobs/{id}/events``.

    ``data`` is the event's whole JSON payload: ``type``, ``step``, ``at`` and the fields of
    its kind (``step_finished``: ``seconds``, ``cached``; ``step_failed``: ``error``;
    ``finished``: ``status``, ``ok``; ...).
    """

    id: int
    type: str
    step: str | None
    at: datetime | None
    data: dict[str, Any]
