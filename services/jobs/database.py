"""The job store's database as every store of it shares it: sessions, job events, the job row lock.

The stores (jobs, step scheduling, workers, tokens, sessions, model names) each keep one
concern; what they share is here:

- reads on PostgreSQL run in autocommit (no BEGIN/COMMIT round trips on the hot GET paths;
  each read is a statement or two and none needs a snapshot across them), writes in one
  transaction that takes SQLite's write lock first (services.jobs.db);
- every transaction that changes a step's state or records a job's events holds the job's
  row lock first (PostgreSQL; SQLite serialises all writers), so a job's event ids are
  committed in increasing order and its newest event id is a version readers can trust;
- a job's plan and spec never change after it is recorded, so each process reads them once
  per job and keeps them (:class:`JobPlan`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, contains_eager, defer, sessionmaker

from services.errors import NotFound
from services.graph.planner import Plan
from services.jobs.db import IMMEDIATE, get_engine
from services.jobs.models import Job, JobEvent, JobEventType, JobStep, utcnow

__all__ = ["JobDatabase", "JobPlan", "job_database"]


@dataclass(frozen=True)
class JobPlan:
    """A job's plan and spec: written once with the job, so cached per process (read-only)."""

    plan: Plan
    plan_dict: dict[str, Any]
    spec: dict[str, Any]
    steps: dict[str, dict[str, Any]]  # step id -> its entry in plan_dict

    @classmethod
    def of(cls, plan_dict: dict[str, Any], spec: dict[str, Any]) -> JobPlan:
        steps = {d["id"]: d for d in plan_dict["steps"]}
        return cls(Plan.from_dict(plan_dict), plan_dict, spec, steps)


class JobDatabase:
    """One job store database; safe to share between threads of a process."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = get_engine(url)
        reader = self.engine
        if self.engine.dialect.name == "postgresql":
            reader = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self._reader = sessionmaker(reader, expire_on_commit=False)
        self.core_reader = reader  # single-statement reads skip the ORM session entirely
        self._writer = sessionmaker(self.engine.execution_options(**{IMMEDIATE: True}), expire_on_commit=False)
        self.pg = self.engine.dialect.name == "postgresql"
        self._plans: OrderedDict[str, JobPlan] = OrderedDict()
        self._plans_lock = threading.Lock()

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

    # --- what every writer of a job shares ------------------------------------------------

    @staticmethod
    def add_event(s: Session, job_id: str, type_: JobEventType, step: str | None = None, **data: Any) -> None:
        s.add(JobEvent(job_id=job_id, type=type_, step=step, data=data, at=utcnow()))

    def lock_job(self, s: Session, job_id: str) -> Job:
        """Lock and load the job's row; NOT_FOUND when unknown."""
        q = select(Job).where(Job.id == job_id)
        if self.pg:
            # FOR NO KEY UPDATE: serialises the job's state changes without blocking inserts of
            # its events (their foreign key takes a KEY SHARE lock, which FOR UPDATE would block).
            q = q.with_for_update(key_share=True)
        job = s.scalars(q).one_or_none()
        if job is None:
            raise NotFound(f"no job {job_id}", hint="List jobs with GET /jobs.")
        return job

    def lock_job_steps(self, s: Session, job_id: str) -> tuple[Job, dict[str, JobStep], JobPlan]:
        """Lock the job's row and load it with its steps (not their logs), in one statement.

        The step rows are locked too: a locking read that had to wait returns the latest
        committed version of every row it locks, where rows it merely joined would be the
        ones its snapshot saw before the wait. ``jobs`` comes first in FROM, so its row is
        locked before the steps', the order every writer follows. The plan and spec come
        along only the first time (they would be decoded once per step row): use the
        returned JobPlan, never ``job.plan``/``job.spec``.
        """
        known = self.known_plan(job_id)
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
        if self.pg:
            q = q.with_for_update(key_share=True)  # FOR NO KEY UPDATE: see lock_job
        rows = s.scalars(q).all()
        if not rows:
            raise NotFound(f"no job {job_id}", hint="List jobs with GET /jobs.")
        job = rows[0].job
        if known is None:
            known = self.remember_plan(job_id, JobPlan.of(job.plan, job.spec))
        return job, {r.step_id: r for r in rows}, known

    def lock_job_row(self, s: Session, job_id: str) -> None:
        """Take the job's row lock without loading it (PostgreSQL; SQLite writers are serial already)."""
        if self.pg:
            s.execute(select(Job.id).where(Job.id == job_id).with_for_update(key_share=True))

    # --- the per-process plan cache -------------------------------------------------------

    def known_plan(self, job_id: str) -> JobPlan | None:
        with self._plans_lock:
            known = self._plans.get(job_id)
            if known is not None:
                self._plans.move_to_end(job_id)
            return known

    def remember_plan(self, job_id: str, known: JobPlan) -> JobPlan:
        with self._plans_lock:
            self._plans[job_id] = known
            while len(self._plans) > 512:
                self._plans.popitem(last=False)
        return known

    def forget_plan(self, job_id: str) -> None:
        with self._plans_lock:
            self._plans.pop(job_id, None)


def job_database(where: JobDatabase | str) -> JobDatabase:
    """Return ``where`` itself, or a JobDatabase on the URL ``where`` (what every store's constructor takes)."""
    return where if isinstance(where, JobDatabase) else JobDatabase(where)
