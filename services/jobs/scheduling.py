"""Step scheduling: claim a step, keep it, record how it ended, move the job on, recover lost work.

The rules that keep a redelivered or duplicated message harmless:

- a step runs only after ``claim_step`` moved it ``queued → running`` (or took over a
  running step whose heartbeat went stale); a second delivery finds it claimed and drops out;
- a result is recorded only by the attempt that claimed the step (``attempt`` matches);
- ``advance`` moves dependents ``pending → queued`` once, under a lock on the job row, and
  returns only the steps it moved, so only one caller enqueues each;
- the job's final status is written once, by whichever ``advance`` sees no open step left;
- every transaction that changes a step's state holds the job's row lock first
  (services.jobs.database; only heartbeats, which change neither state nor events, go without).

The transactions on a step's path are kept to few round trips (under load each one waits
for both processes to be scheduled): the job row is locked and loaded with its steps in one
statement, and the changes go out in one flush at commit.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from services.errors import EngineUnavailable, NotFound
from services.graph.planner import Plan
from services.jobs.database import JobDatabase, JobPlan, job_database
from services.jobs.models import FINAL_JOB_STATES, OPEN_STEP_STATES, Job, JobStep, utcnow
from services.jobs.quotas import lock_tenant, may_start
from services.jobs.webhooks import mark_due
from services.pipeline.fallback import TargetRouting, needed_steps, route_failed_event, route_failures, routing
from services.pipeline.results import blocked_by, target_results
from services.public_errors import public_error
from services.steps.context import Progress

__all__ = ["Advance", "ClaimedStep", "Progress", "StepDeferred", "StepScheduler"]


def _progress_fields(m: Progress) -> dict[str, Any]:
    """Return the ``progress`` event's fields for ``m``: its message, and its ``tune`` data when it has some."""
    if isinstance(m, dict):
        fields: dict[str, Any] = {"message": str(m.get("message", ""))}
        if isinstance(m.get("tune"), dict):
            fields["tune"] = m["tune"]
        return fields
    return {"message": m}


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


class StepDeferred(Exception):
    """The step's job may not start yet: its tenant runs as many jobs as its quota allows."""

    def __init__(self, tenant: str, limit: int) -> None:
        super().__init__(f"tenant {tenant} runs {limit} jobs, its quota")
        self.tenant, self.limit = tenant, limit


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
    tenant: str = ""  # whose job it is: a worker's step children serve one tenant each
    evaluation_key: str | None = None  # the spec's labelled data, stored like the calibration file
    evaluation_sha256: str | None = None
    evaluation_filename: str | None = None


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


class StepScheduler:
    """The steps of every job on one database: what runs next, who runs it, and how it ended."""

    def __init__(self, db: JobDatabase | str) -> None:
        self.db = job_database(db)

    def claim_step(
        self, job_id: str, step_id: str, worker: str, stale_after: float, *, max_running: int | None = None
    ) -> ClaimedStep | None:
        """Take a step for this worker; None when it is not ours to run (done, cancelled, or running elsewhere).

        With ``max_running`` (the setting's running quota), the first step of a job whose tenant
        already runs its quota of jobs is not taken: StepDeferred, and the caller hands the
        delivery back to the queue (services/jobs/quotas.py).
        """
        now = utcnow()
        cutoff = now - timedelta(seconds=stale_after)
        with self.db.write() as s:
            try:
                job, rows, known = self.db.lock_job_steps(s, job_id)
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
            if max_running is not None and job.status == "queued":
                lock_tenant(self.db, s, job.tenant)
                if not may_start(s, job, max_running):
                    raise StepDeferred(job.tenant, job.max_running or max_running)
            return self._take(s, job, known, row, rows, worker, now)

    def _take(
        self,
        s: Session,
        job: Job,
        known: JobPlan,
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
        self.db.add_event(
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
            tenant=job.tenant,
            evaluation_key=job.evaluation_key,
            evaluation_sha256=job.evaluation_sha256,
            evaluation_filename=job.evaluation_filename,
        )

    def step_owner(self, job_id: str, step_id: str) -> tuple[str, str] | None:
        """Return (tenant, engine) of a job's step, or None when there is no such step (one cheap read)."""
        with self.db.read() as s:
            row = s.execute(
                select(Job.tenant, JobStep.engine)
                .join(JobStep, JobStep.job_id == Job.id)
                .where(Job.id == job_id, JobStep.step_id == step_id)
            ).first()
        return (str(row[0]), str(row[1])) if row is not None else None

    def heartbeat(
        self, job_id: str, step_id: str, attempt: int, progress: Sequence[Progress] = ()
    ) -> tuple[bool, bool]:
        """Refresh a running step's heartbeat and record its ``progress``; return (still ours, job cancelled).

        One transaction for both: a step reporting progress costs no extra commit.
        """
        with self.db.write() as s:
            if progress:
                self.db.lock_job_row(s, job_id)
            res = s.execute(_running_attempt(job_id, step_id, attempt).values(heartbeat_at=utcnow()))
            ours = res.rowcount == 1  # type: ignore[attr-defined]
            if ours:
                for m in progress:
                    self.db.add_event(s, job_id, "progress", step_id, **_progress_fields(m))
            cancelled = bool(s.scalar(select(Job.cancel_requested).where(Job.id == job_id)))
            return ours, cancelled

    def progress(self, job_id: str, step_id: str, messages: Sequence[Progress]) -> None:
        """Record progress messages of a running step."""
        if not messages:
            return
        with self.db.write() as s:
            self.db.lock_job_row(s, job_id)
            for m in messages:
                self.db.add_event(s, job_id, "progress", step_id, **_progress_fields(m))

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
        progress: Sequence[Progress] = (),
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
        with self.db.write() as s:
            job, rows, known = self.db.lock_job_steps(s, job_id)
            row = rows.get(step_id)
            # Under the job's lock nothing else moves the step: checked here, true at commit.
            if row is None or row.attempt != attempt or row.status != "running":
                return None
            before = _routing(known.plan, rows)
            row.status, row.finished_at, row.heartbeat_at, row.seconds = status, now, now, seconds
            row.artifact_key, row.cached, row.meta, row.error, row.log = artifact_key, cached, meta, error, log
            for m in progress:
                self.db.add_event(s, job_id, "progress", step_id, **_progress_fields(m))
            if status == "succeeded":
                self.db.add_event(s, job_id, "step_finished", step_id, seconds=round(seconds, 3), cached=cached)
            elif status == "cancelled":
                self.db.add_event(s, job_id, "step_cancelled", step_id)
            else:
                self.db.add_event(s, job_id, "step_failed", step_id, error=error)
            return self.advance_locked(s, job, rows, known, now, continue_on=continue_on, worker=worker, before=before)

    def release_step(self, job_id: str, step_id: str, attempt: int, reason: str) -> bool:
        """Give a claimed step back to its queue (a transient failure; the task will be retried)."""
        with self.db.write() as s:
            self.db.lock_job_row(s, job_id)
            res = s.execute(
                _running_attempt(job_id, step_id, attempt).values(status="queued", worker=None, queued_at=utcnow())
            )
            if res.rowcount == 1:  # type: ignore[attr-defined]
                self.db.add_event(s, job_id, "step_requeued", step_id, reason=reason)
                return True
            return False

    def advance(self, job_id: str) -> Advance:
        """Queue steps whose inputs are done, skip those whose inputs failed, and end the job when nothing is open."""
        with self.db.write() as s:
            job, rows, known = self.db.lock_job_steps(s, job_id)
            return self.advance_locked(s, job, rows, known, utcnow())

    def advance_locked(
        self,
        s: Session,
        job: Job,
        rows: dict[str, JobStep],
        known: JobPlan,
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
                    self.db.add_event(s, job_id, "step_skipped", step.id, because=blocker.get("code"))
                    moved = True
                elif step.id not in may_need:
                    row.status, row.finished_at = "skipped", now
                    row.meta = {"not_needed": "every target using this step is done with an earlier route"}
                elif step.id in now_needed and all(rows[d].status == "succeeded" for d in step.depends_on):
                    row.status, row.queued_at = "queued", now
                    queued.append((step.id, step.engine))
                    self.db.add_event(s, job_id, "step_queued", step.id, queue=step.queue)
        for target, attempt, nxt in route_failures(before, routes):
            event = route_failed_event(target, attempt, nxt)
            del event["type"]
            self.db.add_event(s, job_id, "route_failed", event.pop("step", None), **event)
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
        self.db.add_event(s, job_id, "finished", status=job.status, ok=all_ok, cached=job.cached)
        mark_due(s, job_id, job.status, now)
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
            with self.db.write() as s:
                q = select(Job.status).where(Job.id == job_id)
                if self.db.pg:
                    q = q.with_for_update(key_share=True, skip_locked=True)
                if s.scalar(q) not in ("queued", "running"):
                    continue
                for row in s.scalars(select(JobStep).where(JobStep.job_id == job_id, overdue)).all():
                    if row.status == "running":
                        self.db.add_event(
                            s, job_id, "step_requeued", row.step_id, reason=f"worker {row.worker} stopped heartbeating"
                        )
                        row.worker = None
                    else:
                        self.db.add_event(s, job_id, "step_reannounced", row.step_id)
                    row.status, row.queued_at = "queued", now
                    out.append((job_id, row.step_id, row.engine))
        return out

    def _open_jobs_with_steps(self, condition: Any) -> list[str]:
        """Return up to 200 ids of queued or running jobs with a step matching ``condition``.

        The sweeps' first look: usually finds nothing, so one indexed read without a lock;
        each job found is then re-checked under its own lock.
        """
        with self.db.read() as s:
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
            with self.db.write() as s:
                job, rows, known = self.db.lock_job_steps(s, job_id)
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
                    self.db.add_event(s, job_id, "step_failed", row.step_id, error=error)
                advance = self.advance_locked(s, job, rows, known, now)
                out.extend((job_id, step_id, engine) for step_id, engine in advance.queued)
        return out

    def previous_publish(self, name: str, input_key: str, source_sha256: str) -> dict[str, Any] | None:
        """Return the record of the latest publish of export ``input_key`` under ``name``, if any."""
        with self.db.read() as s:
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

    def queued_steps_by_queue(self) -> dict[str, int]:
        """Return how many steps wait in each queue (the broker-independent queue length)."""
        with self.db.read() as s:
            rows = s.execute(
                select(JobStep.queue, func.count()).where(JobStep.status == "queued").group_by(JobStep.queue)
            ).all()
            return {q: int(n) for q, n in rows}
