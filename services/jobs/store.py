"""Job store operations: every state change of a job or step is one guarded transaction.

The rules that keep a redelivered or duplicated message harmless:

- a step runs only after ``claim_step`` moved it ``queued → running`` (or took over a
  running step whose heartbeat went stale); a second delivery finds it claimed and drops out;
- a result is recorded only by the attempt that claimed the step (``attempt`` matches);
- ``advance`` moves dependents ``pending → queued`` once, under a lock on the job row, and
  returns only the steps it moved, so only one caller enqueues each;
- the job's final status is written once, by whichever ``advance`` sees no open step left;
- every transaction that changes a step's state or records a job's events holds the job's
  row lock first (PostgreSQL; SQLite serialises all writers): the state it read stays true
  until it commits, and a job's event ids are committed in increasing order, so its newest
  event id is a version readers can trust and a follower reading "events after N" never
  skips one committed late (only heartbeats, which change neither, go without it).

The transactions on a step's path are kept to few round trips (under load each one waits
for both processes to be scheduled): the job row is locked and loaded with its steps in one
statement, and the changes go out in one flush at commit. A job's plan and spec never change
after it is recorded, so each process reads them once per job and keeps them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import threading
import uuid
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, exists, func, select, update
from sqlalchemy.orm import Session, contains_eager, defer, selectinload, sessionmaker

from services.errors import Cancelled, EngineUnavailable, KilnError, NotFound
from services.graph.planner import Plan
from services.jobs.db import IMMEDIATE, get_engine
from services.jobs.models import (
    FINAL_JOB_STATES,
    OPEN_STEP_STATES,
    ApiToken,
    Job,
    JobEvent,
    JobStep,
    WorkerRecord,
    utcnow,
)
from services.pipeline.fallback import TargetRouting, needed_steps, route_failed_event, route_failures, routing
from services.pipeline.results import blocked_by, target_results
from services.public_errors import public_error

__all__ = ["Advance", "ClaimedStep", "JobFilter", "JobStore", "JobVersion", "NewJob", "hash_token"]

#: Scopes a token may carry; "write" implies "read", "admin" implies both.
SCOPES = ("read", "write", "admin")


def hash_token(token: str) -> str:
    """Return the stored form of a bearer token."""
    return hashlib.sha256(token.encode()).hexdigest()


def _routing(plan: Plan, rows: dict[str, JobStep]) -> dict[str, TargetRouting]:
    """Return each target's routing from the job's step rows."""
    return routing(
        plan,
        {sid: r.status for sid, r in rows.items()},
        {sid: r.error for sid, r in rows.items() if r.error},
    )


def _running_attempt(job_id: str, step_id: str, attempt: int) -> Any:
    """An UPDATE of one step attempt that only matches while it is still running (so a step
    taken over by another worker, or finished, is left alone: the caller checks rowcount)."""
    return update(JobStep).where(
        JobStep.job_id == job_id,
        JobStep.step_id == step_id,
        JobStep.attempt == attempt,
        JobStep.status == "running",
    )


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
    use_cache: bool = True
    owner: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class ClaimedStep:
    """A step this worker now owns: everything the task needs to run it."""

    job_id: str
    step_id: str
    attempt: int
    step: dict[str, Any]  # the PlanStep as stored in the plan
    spec: dict[str, Any]
    input_keys: dict[str, str]  # role -> artifact key of the step feeding it
    source_key: str
    source_sha256: str
    source_filename: str
    calibration_key: str | None
    calibration_sha256: str | None
    calibration_filename: str | None
    use_cache: bool
    plan: dict[str, Any]
    source_format: str = ""
    source_seen: str = ""
    route_attempts: list[dict[str, Any]] | None = None  # publish steps: the target's routes tried so far


@dataclass(frozen=True)
class _JobPlan:
    """A job's plan and spec: written once with the job, so cached per process (read-only)."""

    plan: Plan
    plan_dict: dict[str, Any]
    spec: dict[str, Any]
    steps: dict[str, dict[str, Any]]  # step id -> its entry in plan_dict

    @classmethod
    def of(cls, plan_dict: dict[str, Any], spec: dict[str, Any]) -> _JobPlan:
        steps = {d["id"]: d for d in plan_dict["steps"]}
        return cls(Plan.from_dict(plan_dict), plan_dict, spec, steps)


@dataclass(frozen=True)
class JobVersion:
    """A job's version (its newest event id) and status, as one read saw them."""

    version: int
    status: str


@dataclass
class Advance:
    """What ``advance`` changed: steps to enqueue, and the final status if the job ended."""

    queued: list[tuple[str, str]]  # (step_id, engine): to enqueue
    final_status: str | None = None
    claimed: ClaimedStep | None = None  # a newly ready step taken by the finishing worker itself


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
    sort: str = "created_at"
    ascending: bool = False

    def clauses(self) -> list[Any]:
        where: list[Any] = []
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


class JobStore:
    """The job store on one database; safe to share between threads of a process."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = get_engine(url)
        # Reads on PostgreSQL run in autocommit: no BEGIN/COMMIT round trips on the hot
        # GET paths. Each read is a statement or two; none needs a snapshot across them.
        reader = self.engine
        if self.engine.dialect.name == "postgresql":
            reader = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self._reader = sessionmaker(reader, expire_on_commit=False)
        self._core_reader = reader  # single-statement reads skip the ORM session entirely
        self._writer = sessionmaker(self.engine.execution_options(**{IMMEDIATE: True}), expire_on_commit=False)
        self._pg = self.engine.dialect.name == "postgresql"
        self._plans: OrderedDict[str, _JobPlan] = OrderedDict()
        self._plans_lock = threading.Lock()

    def _known_plan(self, job_id: str) -> _JobPlan | None:
        with self._plans_lock:
            known = self._plans.get(job_id)
            if known is not None:
                self._plans.move_to_end(job_id)
            return known

    def _remember_plan(self, job_id: str, known: _JobPlan) -> _JobPlan:
        with self._plans_lock:
            self._plans[job_id] = known
            while len(self._plans) > 512:
                self._plans.popitem(last=False)
        return known

    # --- sessions -------------------------------------------------------------------------

    @contextmanager
    def read(self) -> Iterator[Session]:
        """Yield a read-only session."""
        with self._reader() as session, session.begin():
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """Yield a session whose transaction commits on exit (SQLite: takes the write lock first)."""
        with self._writer() as session, session.begin():
            yield session

    def ping(self) -> None:
        """Run a trivial query; raises when the database does not answer."""
        with self.read() as s:
            s.execute(select(1))

    @staticmethod
    def add_event(s: Session, job_id: str, type_: str, step: str | None = None, **data: Any) -> None:
        s.add(JobEvent(job_id=job_id, type=type_, step=step, data=data, at=utcnow()))

    def _lock_job(self, s: Session, job_id: str) -> Job:
        q = select(Job).where(Job.id == job_id)
        if self._pg:
            # FOR NO KEY UPDATE: serialises the job's state changes without blocking inserts of
            # its events (their foreign key takes a KEY SHARE lock, which FOR UPDATE would block).
            q = q.with_for_update(key_share=True)
        job = s.scalars(q).one_or_none()
        if job is None:
            raise NotFound(f"no job {job_id}", hint="List jobs with GET /jobs.")
        return job

    def _lock_job_steps(self, s: Session, job_id: str) -> tuple[Job, dict[str, JobStep], _JobPlan]:
        """Lock the job's row and load it with its steps (not their logs), in one statement.

        The step rows are locked too: a locking read that had to wait returns the latest
        committed version of every row it locks, where rows it merely joined would be the
        ones its snapshot saw before the wait. ``jobs`` comes first in FROM, so its row is
        locked before the steps', the order every writer follows. The plan and spec come
        along only the first time (they would be decoded once per step row): use the
        returned _JobPlan, never ``job.plan``/``job.spec``.
        """
        known = self._known_plan(job_id)
        eager = contains_eager(JobStep.job)
        if known is not None:
            eager = eager.defer(Job.plan).defer(Job.spec)
        q = (
            select(JobStep)
            .select_from(Job)
            .join(JobStep, JobStep.job_id == Job.id)
            .where(Job.id == job_id)
            .options(eager, defer(JobStep.log))
        )
        if self._pg:
            q = q.with_for_update(key_share=True)  # FOR NO KEY UPDATE: see _lock_job
        rows = s.scalars(q).all()
        if not rows:
            raise NotFound(f"no job {job_id}", hint="List jobs with GET /jobs.")
        job = rows[0].job
        if known is None:
            known = self._remember_plan(job_id, _JobPlan.of(job.plan, job.spec))
        return job, {r.step_id: r for r in rows}, known

    def _lock_job_row(self, s: Session, job_id: str) -> None:
        """Take the job's row lock without loading it (PostgreSQL; SQLite writers are serial already)."""
        if self._pg:
            s.execute(select(Job.id).where(Job.id == job_id).with_for_update(key_share=True))

    # --- jobs -----------------------------------------------------------------------------

    def create_job(self, new: NewJob) -> str:
        """Record an accepted job with all its steps pending; return its id."""
        with self.write() as s:
            self._insert_job(s, new, utcnow())
        return new.id

    def submit_job(self, new: NewJob) -> Advance:
        """Record an accepted job and queue its first steps in one transaction; return what to enqueue."""
        now = utcnow()
        with self.write() as s:
            job, rows = self._insert_job(s, new, now)
            return self._advance(s, job, rows, _JobPlan.of(job.plan, job.spec), now)

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
            use_cache=new.use_cache,
            owner=new.owner,
            created_at=now,
        )
        s.add(job)
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
        self.add_event(s, new.id, "submitted", filename=new.source_filename, sha256=new.source_sha256)
        self.add_event(s, new.id, "planned", plan=plan, source=new.source_seen)
        return job, rows

    def get_job(self, job_id: str) -> Job:
        """Return the job with its steps loaded (detached); NOT_FOUND when unknown."""
        with self.read() as s:
            job = s.scalars(select(Job).where(Job.id == job_id).options(selectinload(Job.steps))).one_or_none()
            if job is None:
                raise NotFound(f"no job {job_id}", hint="List jobs with GET /jobs.")
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
        with self.read() as s:
            count = s.scalar(select(func.count()).select_from(Job).where(*where)) or 0
            return list(s.scalars(query).all()), count

    def fail_job(self, job_id: str, error: KilnError) -> None:
        """End a job that cannot proceed (e.g. its first steps could not be enqueued)."""
        now = utcnow()
        with self.write() as s:
            job = self._lock_job(s, job_id)
            if job.status in FINAL_JOB_STATES:
                return
            body, _ = public_error(error.to_dict())
            job.status, job.error, job.finished_at = "failed", body, now
            s.execute(
                update(JobStep)
                .where(JobStep.job_id == job_id, JobStep.status.in_(("pending", "queued")))
                .values(status="skipped", error=body, finished_at=now)
            )
            self.add_event(s, job_id, "failed", error=body)
            self.add_event(s, job_id, "finished", status="failed", ok=False)

    def cancel_job(self, job_id: str) -> bool:
        """Cancel a job: open steps never run, running ones are stopped by their worker.

        Returns False when the job had already ended (nothing changes then).
        """
        now = utcnow()
        err = Cancelled(f"job {job_id} was cancelled").to_dict()
        with self.write() as s:
            job = self._lock_job(s, job_id)
            if job.status in FINAL_JOB_STATES:
                return False
            job.status, job.cancel_requested, job.finished_at = "cancelled", True, now
            job.error = err
            s.execute(
                update(JobStep)
                .where(JobStep.job_id == job_id, JobStep.status.in_(("pending", "queued")))
                .values(status="cancelled", error=err, finished_at=now)
            )
            self.add_event(s, job_id, "cancelled")
            self.add_event(s, job_id, "finished", status="cancelled", ok=False)
            return True

    def events(self, job_id: str, after: int = 0, limit: int = 500) -> list[JobEvent]:
        """Return the job's events with id > ``after``, oldest first."""
        with self.read() as s:
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
        with self._core_reader.connect() as conn:
            return conn.execute(select(func.max(JobEvent.id)).where(JobEvent.job_id == job_id)).scalar()

    def job_versions(self, job_ids: Collection[str]) -> dict[str, JobVersion]:
        """Return the version and status of each known job among ``job_ids`` (unknown ones are left out).

        One statement for any number of jobs: the API answers all the polls waiting at a
        moment with it. The newest event id is read per job from the (job_id, id) index.
        """
        if not job_ids:
            return {}
        newest = select(func.max(JobEvent.id)).where(JobEvent.job_id == Job.id).correlate(Job).scalar_subquery()
        with self._core_reader.connect() as conn:
            rows = conn.execute(select(Job.id, Job.status, newest).where(Job.id.in_(list(job_ids)))).all()
        return {job_id: JobVersion(version or 0, status) for job_id, status, version in rows}

    def job_status(self, job_id: str) -> str:
        """Return only the job's status (cheap; the SSE loop polls it)."""
        with self._core_reader.connect() as conn:
            status = conn.execute(select(Job.status).where(Job.id == job_id)).scalar()
            if status is None:
                raise NotFound(f"no job {job_id}", hint="List jobs with GET /jobs.")
            return status

    # --- steps ----------------------------------------------------------------------------

    def claim_step(self, job_id: str, step_id: str, worker: str, stale_after: float) -> ClaimedStep | None:
        """Take a step for this worker; None when it is not ours to run (done, cancelled, or running elsewhere)."""
        now = utcnow()
        cutoff = now - timedelta(seconds=stale_after)
        with self.write() as s:
            try:
                job, rows, known = self._lock_job_steps(s, job_id)
            except NotFound:
                return None  # a message for a job this store does not know (deleted, or another store's)
            if job.cancel_requested or job.status in FINAL_JOB_STATES:
                return None
            row = rows.get(step_id)
            if row is None:
                return None
            takeover = row.status == "running" and (row.heartbeat_at is None or row.heartbeat_at < cutoff)
            if row.status != "queued" and not takeover:
                return None
            return self._take(s, job, known, row, rows, worker, now)

    def _take(
        self,
        s: Session,
        job: Job,
        known: _JobPlan,
        row: JobStep,
        rows: dict[str, JobStep],
        worker: str,
        now: datetime,
    ) -> ClaimedStep | None:
        """Mark ``row`` running for ``worker``; ``rows`` holds (at least) the steps feeding it."""
        step = known.steps[row.step_id]
        keys: dict[str, str] = {}
        for role, dep in step["inputs"].items():
            if dep == "source":
                continue
            r = rows.get(dep)
            if r is None or r.status != "succeeded" or not r.artifact_key:
                return None  # not runnable yet: a redelivery raced ahead of its input
            keys[role] = r.artifact_key
        attempts = None
        if row.kind == "publish" and row.target:
            routes = _routing(known.plan, rows)
            attempts = [a.to_dict() for a in routes[row.target].tried]
        row.status, row.attempt, row.worker = "running", row.attempt + 1, worker
        row.started_at, row.heartbeat_at, row.input_keys = now, now, keys
        row.finished_at = row.seconds = row.error = None
        if job.status == "queued":
            job.status, job.started_at = "running", now
        self.add_event(
            s, job.id, "step_started", row.step_id, kind=row.kind, engine=row.engine, worker=worker, attempt=row.attempt
        )
        return ClaimedStep(
            job_id=job.id,
            step_id=row.step_id,
            attempt=row.attempt,
            step=step,
            spec=known.spec,
            input_keys=keys,
            source_key=job.source_key,
            source_sha256=job.source_sha256,
            source_filename=job.source_filename,
            calibration_key=job.calibration_key,
            calibration_sha256=job.calibration_sha256,
            calibration_filename=job.calibration_filename,
            use_cache=job.use_cache,
            plan=known.plan_dict,
            source_format=job.source_format,
            source_seen=job.source_seen,
            route_attempts=attempts,
        )

    def heartbeat(self, job_id: str, step_id: str, attempt: int, progress: Sequence[str] = ()) -> tuple[bool, bool]:
        """Refresh a running step's heartbeat and record its ``progress``; return (still ours, job cancelled).

        One transaction for both: a step reporting progress costs no extra commit.
        """
        with self.write() as s:
            if progress:
                self._lock_job_row(s, job_id)
            res = s.execute(_running_attempt(job_id, step_id, attempt).values(heartbeat_at=utcnow()))
            ours = res.rowcount == 1  # type: ignore[attr-defined]
            if ours:
                for m in progress:
                    self.add_event(s, job_id, "progress", step_id, message=m)
            cancelled = bool(s.scalar(select(Job.cancel_requested).where(Job.id == job_id)))
            return ours, cancelled

    def progress(self, job_id: str, step_id: str, messages: Sequence[str]) -> None:
        """Record progress messages of a running step."""
        if not messages:
            return
        with self.write() as s:
            self._lock_job_row(s, job_id)
            for m in messages:
                self.add_event(s, job_id, "progress", step_id, message=m)

    def finish_step(
        self,
        job_id: str,
        step_id: str,
        attempt: int,
        *,
        status: str,
        seconds: float,
        artifact_key: str | None = None,
        cached: bool = False,
        meta: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        log: str | None = None,
        continue_on: Collection[str] = (),
        worker: str = "",
        progress: Sequence[str] = (),
    ) -> Advance | None:
        """Record how a claimed step ended and advance the job, in one transaction.

        Returns what advanced (steps to enqueue, final status), or None when this attempt no
        longer owns the step (it was taken over or cancelled): nothing is recorded then.
        With ``continue_on`` (the engines the finishing worker serves), one newly ready step
        on those engines is claimed for ``worker`` in the same transaction instead of being
        queued: the chain goes on without a round trip through the broker. ``progress``:
        the step's last progress messages not yet recorded, written before its result.
        """
        now = utcnow()
        if error is not None:
            # The job shows a short sanitised excerpt; the tool's full output (a traceback,
            # host paths) goes to the step's log, which GET /jobs/{id}/logs serves operators.
            error, output = public_error(error)
            if output and output not in (log or ""):
                log = f"{log or ''}\n--- error output of {step_id} ---\n{output}".lstrip("\n")
        with self.write() as s:
            job, rows, known = self._lock_job_steps(s, job_id)
            row = rows.get(step_id)
            # Under the job's lock nothing else moves the step: checked here, true at commit.
            if row is None or row.attempt != attempt or row.status != "running":
                return None
            before = _routing(known.plan, rows)
            row.status, row.finished_at, row.heartbeat_at, row.seconds = status, now, now, seconds
            row.artifact_key, row.cached, row.meta, row.error, row.log = artifact_key, cached, meta, error, log
            for m in progress:
                self.add_event(s, job_id, "progress", step_id, message=m)
            if status == "succeeded":
                self.add_event(s, job_id, "step_finished", step_id, seconds=round(seconds, 3), cached=cached)
            elif status == "cancelled":
                self.add_event(s, job_id, "step_cancelled", step_id)
            else:
                self.add_event(s, job_id, "step_failed", step_id, error=error)
            return self._advance(s, job, rows, known, now, continue_on=continue_on, worker=worker, before=before)

    def release_step(self, job_id: str, step_id: str, attempt: int, reason: str) -> bool:
        """Give a claimed step back to its queue (a transient failure; the task will be retried)."""
        with self.write() as s:
            self._lock_job_row(s, job_id)
            res = s.execute(
                _running_attempt(job_id, step_id, attempt).values(status="queued", worker=None, queued_at=utcnow())
            )
            if res.rowcount == 1:  # type: ignore[attr-defined]
                self.add_event(s, job_id, "step_requeued", step_id, reason=reason)
                return True
            return False

    def advance(self, job_id: str) -> Advance:
        """Queue steps whose inputs are done, skip those whose inputs failed, and end the job when nothing is open."""
        with self.write() as s:
            job, rows, known = self._lock_job_steps(s, job_id)
            return self._advance(s, job, rows, known, utcnow())

    def _advance(
        self,
        s: Session,
        job: Job,
        rows: dict[str, JobStep],
        known: _JobPlan,
        now: datetime,
        *,
        continue_on: Collection[str] = (),
        worker: str = "",
        before: dict[str, TargetRouting] | None = None,
    ) -> Advance:
        """Move the job on from the state of its step ``rows`` (loaded under its lock).

        Steps are queued only for each target's route in progress; a route that failed in a
        way another route may avoid hands over to the next (services/pipeline/fallback.py),
        with a ``route_failed`` event. Steps no route can need any more are skipped, with
        ``meta.not_needed`` saying why. ``before``: the routing before the change that
        led here, to tell which routes failed just now.
        """
        job_id = job.id
        if job.status in FINAL_JOB_STATES:
            return Advance(queued=[])
        plan = known.plan
        if before is None:
            before = _routing(plan, rows)
        failed: dict[str, dict[str, Any]] = {
            sid: (r.error or {"code": "INTERNAL", "message": f"step {sid} {r.status}"})
            for sid, r in rows.items()
            if r.status in ("failed", "skipped", "cancelled") and not (r.meta or {}).get("not_needed")
        }
        queued: list[tuple[str, str]] = []
        moved = True
        while moved:  # a skip can end a route, which brings the next route's steps in
            moved = False
            routes = _routing(plan, rows)
            now_needed, may_need = needed_steps(plan, routes)
            for step in plan.steps:  # plan order is dependency order, so skips cascade in one pass
                row = rows[step.id]
                if row.status != "pending":
                    continue
                blocker = blocked_by(step, failed)
                if blocker is not None:
                    row.status, row.error, row.finished_at = "skipped", blocker, now
                    failed[step.id] = blocker
                    self.add_event(s, job_id, "step_skipped", step.id, because=blocker.get("code"))
                    moved = True
                elif step.id not in may_need:
                    row.status, row.finished_at = "skipped", now
                    row.meta = {"not_needed": "every target using this step is done with an earlier route"}
                elif step.id in now_needed and all(rows[d].status == "succeeded" for d in step.depends_on):
                    row.status, row.queued_at = "queued", now
                    queued.append((step.id, step.engine))
                    self.add_event(s, job_id, "step_queued", step.id, queue=step.queue)
        for target, attempt, nxt in route_failures(before, routes):
            event = route_failed_event(target, attempt, nxt)
            self.add_event(s, job_id, event.pop("type"), event.pop("step", None), **event)
        claimed = None
        for step_id, engine in queued:
            if engine in continue_on:
                claimed = self._take(s, job, known, rows[step_id], rows, worker, now)
                if claimed is not None:
                    queued.remove((step_id, engine))
                    break
        if claimed or queued or any(r.status in OPEN_STEP_STATES for r in rows.values()):
            return Advance(queued=queued, claimed=claimed)
        ok_rows = {sid: r for sid, r in rows.items() if r.status == "succeeded"}
        results = target_results(
            plan,
            {sid: (r.meta or {}) for sid, r in ok_rows.items()},
            {sid: r.artifact_key for sid, r in ok_rows.items()},
            failed,
            {sid: r.status for sid, r in rows.items()},
        )
        all_ok = all(t.status == "succeeded" for t in results.values())
        job.status = "succeeded" if all_ok else "failed"
        job.result = {t: r.to_dict() for t, r in results.items()}
        job.cached = all(r.cached for r in rows.values() if not (r.meta or {}).get("not_needed"))
        job.finished_at = now
        self.add_event(s, job_id, "finished", status=job.status, ok=all_ok, cached=job.cached)
        return Advance(queued=[], final_status=job.status)

    def requeue_stale(self, stale_after: float, lost_after: float) -> list[tuple[str, str, str]]:
        """Give back steps whose worker died, and re-announce queued steps whose message may be lost.

        A running step whose heartbeat is older than ``stale_after`` goes back to ``queued``;
        a queued step waiting longer than ``lost_after`` is announced again (a duplicate
        message is harmless: the claim drops it). Returns (job_id, step_id, engine) to enqueue.
        """
        now = utcnow()
        stale_cut = now - timedelta(seconds=stale_after)
        lost_cut = now - timedelta(seconds=lost_after)
        overdue = (JobStep.status == "running") & (JobStep.heartbeat_at < stale_cut) | (JobStep.status == "queued") & (
            JobStep.queued_at < lost_cut
        )
        out: list[tuple[str, str, str]] = []
        for job_id in self._open_jobs_with_steps(overdue):
            # Per job, under its row lock like every other writer of its steps and events
            # (job, then steps: one lock order, no deadlock); a job busy in another
            # transaction is left for the next sweep.
            with self.write() as s:
                q = select(Job.status).where(Job.id == job_id)
                if self._pg:
                    q = q.with_for_update(key_share=True, skip_locked=True)
                if s.scalar(q) not in ("queued", "running"):
                    continue
                for row in s.scalars(select(JobStep).where(JobStep.job_id == job_id, overdue)).all():
                    if row.status == "running":
                        self.add_event(
                            s, job_id, "step_requeued", row.step_id, reason=f"worker {row.worker} stopped heartbeating"
                        )
                        row.worker = None
                    else:
                        self.add_event(s, job_id, "step_reannounced", row.step_id)
                    row.status, row.queued_at = "queued", now
                    out.append((job_id, row.step_id, row.engine))
        return out

    def _open_jobs_with_steps(self, condition: Any) -> list[str]:
        """Return up to 200 ids of queued or running jobs with a step matching ``condition``.

        The sweeps' first look: usually finds nothing, so one indexed read without a lock;
        each job found is then re-checked under its own lock.
        """
        with self.read() as s:
            found = s.execute(
                select(JobStep.job_id)
                .join(Job, Job.id == JobStep.job_id)
                .where(Job.status.in_(("queued", "running")), condition)
                .distinct()
                .limit(200)
            ).all()
        return [job_id for (job_id,) in found]

    def fail_unserved(self, live_engines: Collection[str], waited: float) -> list[tuple[str, str, str]]:
        """Fail queued steps whose engine has no live worker and that waited over ``waited`` seconds.

        Each becomes ENGINE_UNAVAILABLE (with the engine, its queue and the wait), its
        dependents are skipped and the job moves on (other targets may still finish), so no
        job waits forever for a worker that is not there. Returns (job_id, step_id, engine)
        of steps that became ready and must be enqueued.
        """
        now = utcnow()
        cut = now - timedelta(seconds=waited)
        live = sorted(set(live_engines))
        unserved = (JobStep.status == "queued") & (JobStep.queued_at < cut) & JobStep.engine.notin_(live)
        out: list[tuple[str, str, str]] = []
        for job_id in self._open_jobs_with_steps(unserved):
            with self.write() as s:
                job, rows, known = self._lock_job_steps(s, job_id)
                if job.status not in ("queued", "running"):
                    continue
                for row in rows.values():
                    # Re-checked under the job's lock: a worker may have claimed it meanwhile.
                    if row.status != "queued" or row.engine in live or row.queued_at is None or row.queued_at >= cut:
                        continue
                    queue = row.queue
                    error = EngineUnavailable(
                        f"no worker for engine {row.engine} (queue {queue}) took step {row.step_id} in {waited:g} s",
                        hint=f"Start a worker for it (`kiln worker --engine {row.engine}`), or raise "
                        "KILN_WORKER_WAIT_SECONDS if workers come up later.",
                        engine=row.engine,
                        queue=queue,
                        waited_seconds=waited,
                        step=row.step_id,
                    ).to_dict()
                    row.status, row.error, row.finished_at = "failed", error, now
                    self.add_event(s, job_id, "step_failed", row.step_id, error=error)
                advance = self._advance(s, job, rows, known, now)
                out.extend((job_id, step_id, engine) for step_id, engine in advance.queued)
        return out

    def previous_publish(self, name: str, input_key: str, source_sha256: str) -> dict[str, Any] | None:
        """Return the record of the latest publish of export ``input_key`` under ``name``, if any."""
        with self.read() as s:
            rows = s.execute(
                select(JobStep.meta, JobStep.input_keys)
                .join(Job, Job.id == JobStep.job_id)
                .where(Job.source_sha256 == source_sha256)
                .where(JobStep.kind == "publish", JobStep.status == "succeeded", JobStep.cached.is_(False))
                .order_by(JobStep.finished_at.desc())
                .limit(200)
            ).all()
        for meta, keys in rows:
            published = (meta or {}).get("published") or {}
            if (keys or {}).get("model") == input_key and published.get("name") == name:
                return meta  # type: ignore[no-any-return]
        return None

    # --- workers --------------------------------------------------------------------------

    def worker_heartbeat(
        self, hostname: str, *, engines: list[str], versions: dict[str, Any], pid: int, concurrency: int
    ) -> None:
        """Insert or refresh a worker's record."""
        now = utcnow()
        with self.write() as s:
            rec = s.get(WorkerRecord, hostname)
            if rec is None:
                s.add(
                    WorkerRecord(
                        hostname=hostname,
                        engines=engines,
                        versions=versions,
                        pid=pid,
                        concurrency=concurrency,
                        started_at=now,
                        heartbeat_at=now,
                    )
                )
            else:
                rec.engines, rec.versions, rec.pid, rec.concurrency = engines, versions, pid, concurrency
                rec.heartbeat_at, rec.stopped_at = now, None

    def worker_stopped(self, hostname: str) -> None:
        with self.write() as s:
            s.execute(update(WorkerRecord).where(WorkerRecord.hostname == hostname).values(stopped_at=utcnow()))

    def live_workers(self, max_age: float) -> list[WorkerRecord]:
        """Return workers that heartbeated within ``max_age`` seconds and did not stop."""
        cutoff = utcnow() - timedelta(seconds=max_age)
        with self.read() as s:
            return list(
                s.scalars(
                    select(WorkerRecord)
                    .where(WorkerRecord.heartbeat_at >= cutoff, WorkerRecord.stopped_at.is_(None))
                    .order_by(WorkerRecord.hostname)
                ).all()
            )

    def queued_steps_by_queue(self) -> dict[str, int]:
        """Return how many steps wait in each queue (the broker-independent queue length)."""
        with self.read() as s:
            rows = s.execute(
                select(JobStep.queue, func.count()).where(JobStep.status == "queued").group_by(JobStep.queue)
            ).all()
            return {q: int(n) for q, n in rows}

    # --- API tokens -----------------------------------------------------------------------

    def create_token(self, name: str, scopes: Sequence[str] = ("read", "write")) -> str:
        """Create a token and return it in clear text (the only time it is shown)."""
        bad = [sc for sc in scopes if sc not in SCOPES]
        if bad:
            raise KilnError(f"unknown scope(s) {bad}", hint=f"Scopes: {', '.join(SCOPES)}.")
        token_id = secrets.token_hex(4)
        token = f"kiln_{token_id}_{secrets.token_urlsafe(32)}"
        with self.write() as s:
            if s.scalar(select(ApiToken.id).where(ApiToken.name == name)) is not None:
                raise KilnError(f"a token named {name!r} exists", hint="Revoke it first or pick another name.")
            s.add(ApiToken(id=token_id, name=name, token_sha256=hash_token(token), scopes=" ".join(scopes)))
        return token

    def verify_token(self, token: str) -> ApiToken | None:
        """Return the live token record matching ``token``, or None."""
        with self.read() as s:
            rec = s.scalars(select(ApiToken).where(ApiToken.token_sha256 == hash_token(token))).one_or_none()
        if rec is None or rec.revoked_at is not None:
            return None
        return rec

    def revoke_token(self, name: str) -> bool:
        with self.write() as s:
            res = s.execute(
                update(ApiToken).where(ApiToken.name == name, ApiToken.revoked_at.is_(None)).values(revoked_at=utcnow())
            )
            return res.rowcount == 1  # type: ignore[attr-defined]

    def list_tokens(self) -> list[ApiToken]:
        with self.read() as s:
            return list(s.scalars(select(ApiToken).order_by(ApiToken.created_at)).all())

    # --- housekeeping ---------------------------------------------------------------------

    def delete_job(self, job_id: str) -> None:
        """Remove a job and its steps and events (tests and retention)."""
        with self._plans_lock:
            self._plans.pop(job_id, None)
        with self.write() as s:
            s.execute(delete(JobEvent).where(JobEvent.job_id == job_id))
            s.execute(delete(JobStep).where(JobStep.job_id == job_id))
            s.execute(delete(Job).where(Job.id == job_id))

    @staticmethod
    def now() -> datetime:
        return utcnow()
