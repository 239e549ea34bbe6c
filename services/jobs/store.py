"""The jobs themselves: record, read, list, cancel and fail jobs, and their events and versions.

Steps are scheduled by services.jobs.scheduling, workers by services.jobs.worker_registry,
tokens by services.jobs.tokens; this store holds what a job is and how it ended. Each job
belongs to a tenant: the reads and changes that take ``tenant`` find only that tenant's
jobs (None: every tenant's, for admin tokens and the service itself), and answer NOT_FOUND
for another's, as for a job that does not exist.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import delete, exists, func, select, update
from sqlalchemy.orm import Session, defer, selectinload

from services.errors import Cancelled, KilnError, NotFound
from services.graph.planner import Plan
from services.jobs.database import JobDatabase, JobPlan, job_database
from services.jobs.idempotency import IdempotencyClaim, claim_key
from services.jobs.model_names import claim_names, published_names
from services.jobs.models import (
    DEFAULT_TENANT,
    FINAL_JOB_STATES,
    IdempotencyKey,
    Job,
    JobEvent,
    JobStep,
    Webhook,
    utcnow,
)
from services.jobs.quotas import TenantQuota, check_queued, lock_tenant
from services.jobs.scheduling import Advance, StepScheduler
from services.jobs.webhooks import NewWebhook, mark_due, record_webhook
from services.public_errors import public_error

__all__ = ["JobFilter", "JobStore", "JobVersion", "NewJob"]


@dataclass
class NewJob:
    """What the API records for an accepted upload."""

    name: str
    spec: dict[str, Any]
    plan: Plan
    source_key: str
    source_sha256: str
    source_filename: str
    source_format: str
    source_seen: str = ""
    source_size: int = 0
    calibration_key: str | None = None
    calibration_sha256: str | None = None
    calibration_filename: str | None = None
    evaluation_key: str | None = None
    evaluation_sha256: str | None = None
    evaluation_filename: str | None = None
    use_cache: bool = True
    owner: str | None = None
    tenant: str = DEFAULT_TENANT
    webhook: NewWebhook | None = None  # the spec's notify, with its secret (kept out of ``spec``)
    quota: TenantQuota | None = None  # the submitter's quotas (services/jobs/quotas.py); None: none checked
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True)
class JobVersion:
    """A job's version (its newest event id), status and tenant, as one read saw them."""

    version: int
    status: str
    tenant: str = DEFAULT_TENANT


#: What GET /jobs can sort by.
_SORT_COLUMNS: dict[str, Any] = {
    "created_at": Job.created_at,
    "finished_at": Job.finished_at,
    "name": Job.name,
    "status": Job.status,
}


@dataclass(frozen=True)
class JobFilter:
    """Which jobs a listing shows and in what order (every field optional)."""

    status: str | None = None
    name: str | None = None
    target: str | None = None  # a job with a step for this target
    engine: str | None = None  # a job with a step on this engine
    precision: str | None = None
    source_sha256: str | None = None  # a prefix of it is enough
    created_after: datetime | None = None
    created_before: datetime | None = None
    tenant: str | None = None  # None: every tenant's jobs
    sort: str = "created_at"
    ascending: bool = False

    def clauses(self) -> list[Any]:
        where: list[Any] = []
        if self.tenant is not None:
            where.append(Job.tenant == self.tenant)
        if self.status:
            where.append(Job.status == self.status)
        if self.name:
            where.append(Job.name == self.name)
        if self.precision:
            where.append(Job.precision == self.precision)
        if self.source_sha256:
            sha = self.source_sha256.lower()
            # A whole hash is an equality the (source_sha256, created_at) index serves in order.
            where.append(
                Job.source_sha256 == sha if len(sha) == 64 else Job.source_sha256.startswith(sha, autoescape=True)
            )
        if self.created_after:
            where.append(Job.created_at >= self.created_after)
        if self.created_before:
            where.append(Job.created_at < self.created_before)
        if self.target:
            where.append(exists().where(JobStep.job_id == Job.id, JobStep.target == self.target))
        if self.engine:
            where.append(exists().where(JobStep.job_id == Job.id, JobStep.engine == self.engine))
        return where


def _no_job(job_id: str) -> NotFound:
    return NotFound(f"no job {job_id}", hint="List jobs with GET /jobs.")


class JobStore:
    """The jobs on one database; safe to share between threads of a process."""

    def __init__(self, db: JobDatabase | str) -> None:
        self.db = job_database(db)
        self.url = self.db.url
        self._steps = StepScheduler(self.db)  # a job's first steps are queued with it

    def ping(self) -> None:
        """Run a trivial query; raises when the database does not answer."""
        self.db.ping()

    # --- recording ------------------------------------------------------------------------

    def create_job(self, new: NewJob) -> str:
        """Record an accepted job with all its steps pending; return its id."""
        with self.db.write() as s:
            self._insert_job(s, new, utcnow())
        return new.id

    def submit_job(
        self, new: NewJob, *, any_names: bool = False, idempotency: IdempotencyClaim | None = None
    ) -> Advance:
        """Record an accepted job and queue its first steps in one transaction; return what to enqueue.

        The model names the job publishes under are claimed for its tenant in the same
        transaction: a name another tenant owns is FORBIDDEN, unless ``any_names`` (an admin).
        So is ``idempotency``'s key: when another job holds it, nothing is recorded and
        :class:`~services.jobs.idempotency.KeyTaken` names that job. With ``new.quota``, a tenant
        with that many jobs waiting to start already gets QUOTA_EXCEEDED and nothing is recorded.
        """
        now = utcnow()
        with self.db.write() as s:
            if new.quota is not None:  # first: a refused job takes no lock on its names
                lock_tenant(self.db, s, new.tenant)
                check_queued(s, new.tenant, new.quota)
            claim_names(s, new.tenant, published_names(new.plan), any_owner=any_names)
            job, rows = self._insert_job(s, new, now)
            if idempotency is not None:
                claim_key(s, idempotency, new.id, now)
            return self._steps.advance_locked(s, job, rows, JobPlan.of(job.plan, job.spec), now)

    def _insert_job(self, s: Session, new: NewJob, now: datetime) -> tuple[Job, dict[str, JobStep]]:
        plan = new.plan.to_dict()
        job = Job(
            id=new.id,
            status="queued",
            name=new.name,
            spec=new.spec,
            precision=str(new.spec.get("precision", "fp32")),
            plan=plan,
            source_key=new.source_key,
            source_sha256=new.source_sha256,
            source_filename=new.source_filename,
            source_format=new.source_format,
            source_seen=new.source_seen,
            source_size=new.source_size,
            calibration_key=new.calibration_key,
            calibration_sha256=new.calibration_sha256,
            calibration_filename=new.calibration_filename,
            evaluation_key=new.evaluation_key,
            evaluation_sha256=new.evaluation_sha256,
            evaluation_filename=new.evaluation_filename,
            use_cache=new.use_cache,
            owner=new.owner,
            tenant=new.tenant,
            created_at=now,
            max_running=new.quota.max_running if new.quota is not None else None,
        )
        s.add(job)
        if new.webhook is not None:
            record_webhook(s, new.id, new.webhook)
        rows = {}
        for i, step in enumerate(new.plan.steps):
            rows[step.id] = JobStep(
                job_id=new.id,
                step_id=step.id,
                position=i,
                kind=step.kind,
                engine=step.engine,
                queue=step.queue,
                target=step.target,
                status="pending",
                attempt=0,
                cached=False,
            )
            s.add(rows[step.id])
        s.flush()
        self.db.add_event(s, new.id, "submitted", filename=new.source_filename, sha256=new.source_sha256)
        self.db.add_event(s, new.id, "planned", plan=plan, source=new.source_seen)
        return job, rows

    # --- reading --------------------------------------------------------------------------

    def get_job(self, job_id: str, tenant: str | None = None) -> Job:
        """Return the job with its steps loaded (detached); NOT_FOUND when unknown or another tenant's."""
        with self.db.read() as s:
            job = s.scalars(select(Job).where(Job.id == job_id).options(selectinload(Job.steps))).one_or_none()
            if job is None or (tenant is not None and job.tenant != tenant):
                raise _no_job(job_id)
            return job

    def list_jobs(
        self,
        *,
        status: str | None = None,
        name: str | None = None,
        limit: int = 50,
        offset: int = 0,
        filters: JobFilter | None = None,
        with_steps: bool = True,
    ) -> tuple[list[Job], int]:
        """Return one page of jobs (newest first unless ``filters`` sorts otherwise) and how many match."""
        f = filters or JobFilter()
        if status or name:
            f = dataclasses.replace(f, status=status or f.status, name=name or f.name)
        where = f.clauses()
        column = _SORT_COLUMNS[f.sort]
        order = [column.asc() if f.ascending else column.desc(), Job.id]
        query = select(Job).where(*where).order_by(*order).limit(limit).offset(offset)
        if with_steps:
            query = query.options(selectinload(Job.steps))
        else:
            # The dashboard's list shows headlines only: spec, plan, results and steps stay unread.
            query = query.options(defer(Job.plan), defer(Job.result), defer(Job.error))
        with self.db.read() as s:
            count = s.scalar(select(func.count()).select_from(Job).where(*where)) or 0
            return list(s.scalars(query).all()), count

    def count_by_status(self) -> dict[str, int]:
        """Return how many jobs are in each status (the metrics' gauge)."""
        with self.db.read() as s:
            return {st: int(n) for st, n in s.execute(select(Job.status, func.count()).group_by(Job.status)).all()}

    def events(self, job_id: str, after: int = 0, limit: int = 500) -> list[JobEvent]:
        """Return the job's events with id > ``after``, oldest first."""
        with self.db.read() as s:
            return list(
                s.scalars(
                    select(JobEvent)
                    .where(JobEvent.job_id == job_id, JobEvent.id > after)
                    .order_by(JobEvent.id)
                    .limit(limit)
                ).all()
            )

    def job_version(self, job_id: str) -> int | None:
        """Return the id of the job's newest event (None for an unknown job).

        Every change the job's public view shows is recorded together with an event, so this
        number changes whenever the view does: a cheap "has anything changed?" query.
        """
        with self.db.core_reader.connect() as conn:
            return conn.execute(select(func.max(JobEvent.id)).where(JobEvent.job_id == job_id)).scalar()

    def job_versions(self, job_ids: Collection[str]) -> dict[str, JobVersion]:
        """Return the version, status and tenant of each known job among ``job_ids`` (unknown ones are left out).

        One statement for any number of jobs: the API answers all the polls waiting at a
        moment with it. The newest event id is read per job from the (job_id, id) index.
        """
        if not job_ids:
            return {}
        newest = select(func.max(JobEvent.id)).where(JobEvent.job_id == Job.id).correlate(Job).scalar_subquery()
        with self.db.core_reader.connect() as conn:
            rows = conn.execute(select(Job.id, Job.status, Job.tenant, newest).where(Job.id.in_(list(job_ids)))).all()
        return {job_id: JobVersion(version or 0, status, tenant) for job_id, status, tenant, version in rows}

    def job_status(self, job_id: str, tenant: str | None = None) -> str:
        """Return only the job's status (cheap; the SSE loop polls it); NOT_FOUND for another tenant's."""
        with self.db.core_reader.connect() as conn:
            row = conn.execute(select(Job.status, Job.tenant).where(Job.id == job_id)).one_or_none()
            if row is None or (tenant is not None and row.tenant != tenant):
                raise _no_job(job_id)
            return str(row.status)

    # --- ending ---------------------------------------------------------------------------

    def fail_job(self, job_id: str, error: KilnError) -> None:
        """End a job that cannot proceed (e.g. its first steps could not be enqueued)."""
        now = utcnow()
        with self.db.write() as s:
            job = self.db.lock_job(s, job_id)
            if job.status in FINAL_JOB_STATES:
                return
            body, _ = public_error(error.to_dict())
            job.status, job.error, job.finished_at = "failed", body, now
            s.execute(
                update(JobStep)
                .where(JobStep.job_id == job_id, JobStep.status.in_(("pending", "queued")))
                .values(status="skipped", error=body, finished_at=now)
            )
            self.db.add_event(s, job_id, "failed", error=body)
            self.db.add_event(s, job_id, "finished", status="failed", ok=False)
            mark_due(s, job_id, "failed", now)

    def cancel_job(self, job_id: str, tenant: str | None = None) -> bool:
        """Cancel a job: open steps never run, running ones are stopped by their worker.

        Returns False when the job had already ended (nothing changes then); NOT_FOUND for
        another tenant's job.
        """
        now = utcnow()
        err = Cancelled(f"job {job_id} was cancelled").to_dict()
        with self.db.write() as s:
            job = self.db.lock_job(s, job_id)
            if tenant is not None and job.tenant != tenant:
                raise _no_job(job_id)
            if job.status in FINAL_JOB_STATES:
                return False
            job.status, job.cancel_requested, job.finished_at = "cancelled", True, now
            job.error = err
            s.execute(
                update(JobStep)
                .where(JobStep.job_id == job_id, JobStep.status.in_(("pending", "queued")))
                .values(status="cancelled", error=err, finished_at=now)
            )
            self.db.add_event(s, job_id, "cancelled")
            self.db.add_event(s, job_id, "finished", status="cancelled", ok=False)
            mark_due(s, job_id, "cancelled", now)
            return True

    # --- housekeeping ---------------------------------------------------------------------

    def delete_job(self, job_id: str) -> None:
        """Remove a job and its steps and events (tests and retention)."""
        self.db.forget_plan(job_id)
        with self.db.write() as s:
            s.execute(delete(IdempotencyKey).where(IdempotencyKey.job_id == job_id))
            s.execute(delete(Webhook).where(Webhook.job_id == job_id))
            s.execute(delete(JobEvent).where(JobEvent.job_id == job_id))
            s.execute(delete(JobStep).where(JobStep.job_id == job_id))
            s.execute(delete(Job).where(Job.id == job_id))

    @staticmethod
    def now() -> datetime:
        return utcnow()
