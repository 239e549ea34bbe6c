"""SQLAlchemy models of the job store (the Alembic migrations create exactly these tables)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar, Literal, get_args

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

__all__ = [
    "DEFAULT_TENANT",
    "FINAL_JOB_STATES",
    "JOB_EVENT_TYPES",
    "OPEN_STEP_STATES",
    "ApiToken",
    "Base",
    "DashboardSession",
    "IdempotencyKey",
    "Job",
    "JobEvent",
    "JobEventType",
    "JobStep",
    "ModelName",
    "UTCDateTime",
    "Webhook",
    "WorkerRecord",
    "utcnow",
]

#: The tenant of tokens created without one, of jobs made with auth off, and of every job and
#: model name recorded before tenants existed (migration 0004).
DEFAULT_TENANT = "default"

#: A job ends in one of these; nothing moves it out again.
FINAL_JOB_STATES = ("succeeded", "failed", "cancelled")
#: Steps in these states may still run; a job is finished when none of its steps is in one.
OPEN_STEP_STATES = ("pending", "queued", "running")

#: Every kind of job event the store records (``add_event`` takes only these). GET
#: /jobs/{id}/events streams them; api/events.py declares each one's fields for the API's
#: document, and tests/test_api_schemathesis.py checks both lists stay the same.
JobEventType = Literal[
    "submitted",
    "planned",
    "step_queued",
    "step_started",
    "progress",
    "step_finished",
    "step_failed",
    "step_cancelled",
    "step_skipped",
    "step_requeued",
    "step_reannounced",
    "route_failed",
    "failed",
    "cancelled",
    "finished",
    "webhook_delivered",
    "webhook_failed",
    "webhook_gave_up",
]
JOB_EVENT_TYPES: tuple[JobEventType, ...] = get_args(JobEventType)


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        value = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# An autoincrementing 64-bit key that SQLite also accepts (it only autoincrements INTEGER).
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, list[Any]: JSON, datetime: UTCDateTime}


class Job(Base):
    """One POST /compile: what was uploaded, the spec, the plan, and how it ended."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), index=True)  # queued|running|succeeded|failed|cancelled
    name: Mapped[str] = mapped_column(String(128), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    # spec.precision as a column: the job list filters on it (reading it out of the JSON
    # parses every row's spec).
    precision: Mapped[str | None] = mapped_column(String(8), nullable=True, index=True)
    plan: Mapped[dict[str, Any]] = mapped_column(JSON)
    source_key: Mapped[str] = mapped_column(String(255))
    source_sha256: Mapped[str] = mapped_column(String(64), index=True)
    source_filename: Mapped[str] = mapped_column(String(255))
    source_format: Mapped[str] = mapped_column(String(32))
    source_seen: Mapped[str] = mapped_column(Text, default="")
    source_size: Mapped[int] = mapped_column(BigInteger, default=0)
    calibration_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    calibration_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    calibration_filename: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # The spec's labelled data (evaluation.data), uploaded and stored like the calibration file.
    evaluation_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    evaluation_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    evaluation_filename: Mapped[str | None] = mapped_column(String(255), nullable=True)
    use_cache: Mapped[bool] = mapped_column(Boolean, default=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # The team the job belongs to: its token's tenant. Reads and changes by a token of another
    # tenant find no such job (admin tokens see every tenant's).
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT, index=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # per-target results
    cached: Mapped[bool | None] = mapped_column(Boolean, nullable=True)  # every step came from the cache
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # How many jobs of its tenant may run at once, as its token said at submission (None: the
    # setting's); read when its first step is claimed (services/jobs/quotas.py).
    max_running: Mapped[int | None] = mapped_column(Integer, nullable=True)

    __table_args__ = (Index("ix_jobs_tenant_status", "tenant", "status"),)

    steps: Mapped[list[JobStep]] = relationship(
        back_populates="job", order_by="JobStep.position", cascade="all, delete-orphan"
    )


class JobStep(Base):
    """One plan step of a job and its run: the unit a worker claims."""

    __tablename__ = "job_steps"
    # "Jobs with a step for this target / on this engine" (the job list's filters).
    __table_args__ = (
        Index("ix_job_steps_target_job_id", "target", "job_id"),
        Index("ix_job_steps_engine_job_id", "engine", "job_id"),
    )

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    step_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    position: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    engine: Mapped[str] = mapped_column(String(32))
    queue: Mapped[str] = mapped_column(String(64))
    target: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # pending|queued|running|succeeded|failed|skipped|cancelled
    status: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    queued_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, index=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    cached: Mapped[bool] = mapped_column(Boolean, default=False)
    input_keys: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    artifact_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    meta: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    log: Mapped[str | None] = mapped_column(Text, nullable=True)

    job: Mapped[Job] = relationship(back_populates="steps")


class JobEvent(Base):
    """A progress event of a job, in order; the SSE stream and the logs read these."""

    __tablename__ = "job_events"
    # (job_id, id): the SSE stream reads "events of a job after id N", and a job's newest
    # event id is its version (GET /jobs/{id} serves a cached body while it is unchanged).
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    type: Mapped[str] = mapped_column(String(32))
    step: Mapped[str | None] = mapped_column(String(255), nullable=True)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class ApiToken(Base):
    """A bearer token, stored only as its SHA-256 (tokens are random, so no slow hash is needed)."""

    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[str] = mapped_column(String(128))  # space-separated: read write admin
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # This token's own quotas for its tenant's jobs (None: KILN_TENANT_MAX_RUNNING_JOBS / _QUEUED_JOBS).
    max_running_jobs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_queued_jobs: Mapped[int | None] = mapped_column(Integer, nullable=True)


class WorkerRecord(Base):
    """A worker process and the engines it serves; live while its heartbeat is fresh."""

    __tablename__ = "workers"

    hostname: Mapped[str] = mapped_column(String(255), primary_key=True)
    engines: Mapped[list[Any]] = mapped_column(JSON)
    versions: Mapped[dict[str, Any]] = mapped_column(JSON)
    pid: Mapped[int] = mapped_column(Integer)
    concurrency: Mapped[int] = mapped_column(Integer, default=1)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    stopped_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class ModelName(Base):
    """A published model name and the tenant that owns it: the first to publish under it.

    Claimed in the transaction that records the job, so two tenants racing for one name
    cannot both get it; a name is never released (a version published under it stays).
    """

    __tablename__ = "model_names"

    name: Mapped[str] = mapped_column(String(160), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class DashboardSession(Base):
    """A signed-in dashboard: the cookie carries only a signed random id whose hash is the key here.

    The API token stays on the server; signing out deletes the row, and revoking the token
    ends its sessions (they are read joined to a live token).
    """

    __tablename__ = "dashboard_sessions"

    id_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[str] = mapped_column(ForeignKey("api_tokens.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


class IdempotencyKey(Base):
    """A submit's ``Idempotency-Key``, per tenant: the job it made and a fingerprint of its request.

    The same key with the same request within a day answers that job again; with another
    request, IDEMPOTENCY_KEY_REUSED. Recorded in the transaction that records the job.
    """

    __tablename__ = "idempotency_keys"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)


class Webhook(Base):
    """A job's webhook (the spec's ``notify``) and its delivery: waiting for the job's end, due, delivered or given up.

    The secret is kept here, never in the job's spec. The job's final transition marks it
    due; any API process delivers it (a claim with a lease keeps two from sending at once).
    """

    __tablename__ = "webhooks"
    __table_args__ = (Index("ix_webhooks_state_next_at", "state", "next_at"),)

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    url: Mapped[str] = mapped_column(String(2048))
    events: Mapped[list[Any]] = mapped_column(JSON)
    secret: Mapped[str] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16), default="waiting")  # waiting|due|delivered|gave_up|not_sent
    event: Mapped[str | None] = mapped_column(String(16), nullable=True)  # the job's final status
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    claimed_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
