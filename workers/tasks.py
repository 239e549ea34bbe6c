"""The step task: claim a step in the job store, run it (from the cache or in a child), record, advance.

The broker message carries only ``(job_id, step_id)``; everything else is loaded from the
job store, and every outcome goes back there before the dependents are enqueued on their
own engines' queues. A delivery that finds its step already claimed, done or cancelled
does nothing, which makes redelivery after a worker loss safe.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from services.artifacts import Artifact
from services.errors import KilnError
from services.graph.planner import PlanStep
from services.jobs.backends import open_repository, open_store
from services.jobs.db import database_url
from services.jobs.quotas import DEFER_SECONDS
from services.jobs.scheduling import ClaimedStep, Progress, StepDeferred, StepScheduler
from services.pipeline.executor import step_cache_key
from services.settings import Settings
from services.spec import CompileSpec
from workers.child import ChildResult, StepRequest, fetch_local, run_in_child
from workers.queues import enqueue_steps
from workers.slots import slots

__all__ = ["StepRun", "execute_step", "worker_name"]

log = logging.getLogger("kiln.worker")


def worker_name() -> str:
    """Return this process's name in step records: host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class StepRun:
    """What one delivery of a step did (returned by the task, for logs and tests)."""

    job_id: str
    step_id: str
    outcome: str  # skipped | deferred | succeeded | failed | cancelled | lost
    cached: bool = False
    timings: dict[str, float] = field(default_factory=dict)  # ms: claim, run, step, record, enqueue

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _cached_artifact(claim: ClaimedStep, step: PlanStep, spec: CompileSpec, store: Any, settings: Settings) -> Any:
    """Return (key, meta) when the step's output is already in the store; else None.

    The key is the executor's own (step_cache_key over the same inputs), so a hit here is
    exactly a hit the child would have found, without paying for a child.
    """
    if not claim.use_cache or step.kind == "publish":
        return None
    keys = {**claim.input_keys, "source": claim.source_sha256}
    key = step_cache_key(step, spec, keys, claim.calibration_sha256, claim.evaluation_sha256)
    if not store.exists(key):
        return None
    local = fetch_local(store, key, settings.cache_dir / "worker-fetch")
    meta = Artifact.load(local).meta
    return key, {k: v for k, v in meta.items() if k not in ("lineage", "signature")}


def _cached_publish(
    claim: ClaimedStep, step: PlanStep, spec: CompileSpec, jobs: StepScheduler, settings: Settings
) -> Any:
    """Return the meta of an earlier publish of this very export under this name, when it still stands."""
    if not claim.use_cache or step.kind != "publish":
        return None
    prev = jobs.previous_publish(step.options["name"], claim.input_keys.get("model", ""), claim.source_sha256)
    if prev is None:
        return None
    published = prev["published"]
    if spec.version is not None and spec.version != published["version"]:
        return None
    from services.repository.publish import read_manifest

    repo = open_repository(settings)
    try:
        manifest = read_manifest(repo, published["name"], int(published["version"]))
    except KilnError:
        return None  # the version is gone from the repository: publish again
    if manifest.get("source", {}).get("sha256") != claim.source_sha256:
        return None
    return {**prev, "reused": True}


class _StepKeeper(threading.Thread):
    """Heartbeats a claimed step and records its progress from claim to result.

    A thread of its own, so the step keeps its claim whatever the task is doing meanwhile
    (waiting for a child, fetching a large input from S3, running the step); it notices a
    cancel or a takeover and says so through ``verdict``. Progress goes out with the
    heartbeat (one transaction per interval), and what is left at the end with the step's
    result: a step costs no commit of its own for its progress lines.
    """

    def __init__(self, jobs: StepScheduler, claim: ClaimedStep, interval: float) -> None:
        super().__init__(name=f"kiln-keeper-{claim.step_id}", daemon=True)
        self.jobs, self.claim, self.interval = jobs, claim, interval
        self.verdict: str | None = None  # "cancel" | "lost"
        self._pending: list[Progress] = []
        self._lock = threading.Lock()
        self._stop_event = threading.Event()

    def progress(self, message: Progress) -> None:
        with self._lock:
            self._pending.append(message)

    def take_pending(self) -> list[Progress]:
        """Return (and forget) the progress lines not recorded yet."""
        with self._lock:
            batch, self._pending = self._pending, []
        return batch

    def beat(self) -> None:
        batch = self.take_pending()
        try:
            ours, cancelled = self.jobs.heartbeat(self.claim.job_id, self.claim.step_id, self.claim.attempt, batch)
        except Exception:  # progress is best effort; the heartbeat is retried next interval
            log.warning("heartbeat failed for %s/%s", self.claim.job_id, self.claim.step_id, exc_info=True)
            return
        if cancelled:
            self.verdict = "cancel"
        elif not ours:
            self.verdict = "lost"

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.beat()

    def stop(self) -> list[Progress]:
        """Stop beating; return the progress lines still to record (with the step's result)."""
        self._stop_event.set()
        if self.is_alive():
            self.join()
        return self.take_pending()


@dataclass
class _Ran:
    """A claimed step's outcome and the progress lines that go into the same record."""

    result: ChildResult
    progress: list[Progress]


def _run_claimed(claim: ClaimedStep, jobs: StepScheduler, settings: Settings) -> _Ran:
    step = PlanStep.from_dict(claim.step)
    spec = CompileSpec.model_validate(claim.spec)
    started = time.monotonic()
    # Cancellation is noticed within a second even with a slow heartbeat setting.
    keeper = _StepKeeper(jobs, claim, interval=min(settings.step_heartbeat_interval, 1.0))
    keeper.start()
    scratch: Path | None = None
    result: ChildResult | None = None
    try:
        store = open_store(settings)
        hit = _cached_artifact(claim, step, spec, store, settings)
        if hit is not None:
            key, meta = hit
            result = ChildResult(ok=True, key=key, cached=True, seconds=time.monotonic() - started, meta=meta)
            return _Ran(result, keeper.stop())
        reused = _cached_publish(claim, step, spec, jobs, settings)
        if reused is not None:
            result = ChildResult(ok=True, cached=True, seconds=time.monotonic() - started, meta=reused)
            return _Ran(result, keeper.stop())
        scratch = Path(tempfile.mkdtemp(prefix="kiln-step-", dir=_scratch_root(settings)))
        req = StepRequest(
            job_id=claim.job_id,
            step=claim.step,
            spec=claim.spec,
            source_key=claim.source_key,
            source_filename=claim.source_filename,
            input_keys=claim.input_keys,
            settings=settings,
            scratch=scratch,
            calibration_key=claim.calibration_key,
            calibration_filename=claim.calibration_filename,
            calibration_sha256=claim.calibration_sha256,
            evaluation_key=claim.evaluation_key,
            evaluation_filename=claim.evaluation_filename,
            evaluation_sha256=claim.evaluation_sha256,
            use_cache=claim.use_cache,
            source_format=claim.source_format,
            source_sha256=claim.source_sha256,
            source_seen=claim.source_seen,
            route_attempts=claim.route_attempts,
            tenant=claim.tenant,
        )
        result = run_in_child(
            req,
            soft_limit=settings.step_soft_time_limit,
            hard_limit=settings.step_hard_time_limit,
            on_progress=keeper.progress,
            tick=lambda: keeper.verdict,
            tick_interval=0.2,
        )
        return _Ran(result, keeper.stop())
    finally:
        if result is None:  # an error around the step: it is handed back, its progress kept if possible
            pending = keeper.stop()
            if pending:
                try:
                    jobs.progress(claim.job_id, claim.step_id, pending)
                except Exception:
                    log.warning("could not record progress of %s/%s", claim.job_id, claim.step_id, exc_info=True)
        if scratch is not None:
            # Off the step's path: the next step of the chain need not wait for the removal.
            threading.Thread(target=shutil.rmtree, args=(scratch,), kwargs={"ignore_errors": True}).start()


def _scratch_root(settings: Settings) -> Path:
    root = settings.cache_dir / "scratch"
    root.mkdir(parents=True, exist_ok=True)
    return root


def execute_step(
    job_id: str,
    step_id: str,
    *,
    settings: Settings,
    celery_app: Any,
    jobs: StepScheduler | None = None,
    engines: Collection[str] = (),
) -> list[StepRun]:
    """Run one delivery of ``(job_id, step_id)``, then the steps it hands on; return what each did.

    When a finished step makes another step ready on one of ``engines`` (those this worker
    serves), that step is claimed in the same transaction and run here next, without a trip
    through the broker; the rest are enqueued on their own queues as usual.
    """
    jobs = jobs or _job_store(database_url(settings))
    t0 = time.perf_counter()
    owner = jobs.step_owner(job_id, step_id)
    if owner is None:
        return [StepRun(job_id, step_id, "skipped")]
    tenant, engine = owner
    if not slots.take(tenant):  # the last free slot here is kept for another tenant (workers/slots.py)
        return [_defer(celery_app, job_id, step_id, engine, f"tenant {tenant} may not take this worker's last slot")]
    try:
        try:
            claim = jobs.claim_step(
                job_id, step_id, worker_name(), settings.step_stale_after, max_running=settings.tenant_max_running_jobs
            )
        except StepDeferred as wait:  # its tenant runs its quota of jobs (services/jobs/quotas.py)
            return [_defer(celery_app, job_id, step_id, engine, str(wait))]
        if claim is None:
            log.info(
                "step %s of job %s is not runnable here (done, cancelled or owned); dropping delivery", step_id, job_id
            )
            return [StepRun(job_id, step_id, "skipped")]
        runs = []
        claim_ms = (time.perf_counter() - t0) * 1000
        while claim is not None:
            run, claim = _run_and_record(claim, jobs, settings, celery_app, engines, claim_ms)
            runs.append(run)
            claim_ms = 0.0  # the next one was claimed while recording this one
        return runs
    finally:
        slots.give_back(tenant)


def _defer(celery_app: Any, job_id: str, step_id: str, engine: str, why: str) -> StepRun:
    """Hand a delivery back to its queue, due in DEFER_SECONDS: this worker takes the next one meanwhile."""
    enqueue_steps(celery_app, job_id, [(step_id, engine)], countdown=DEFER_SECONDS)
    log.info("step %s of job %s waits: %s", step_id, job_id, why)
    return StepRun(job_id, step_id, "deferred")


def _run_and_record(
    claim: ClaimedStep,
    jobs: StepScheduler,
    settings: Settings,
    celery_app: Any,
    engines: Collection[str],
    claim_ms: float,
) -> tuple[StepRun, ClaimedStep | None]:
    job_id, step_id = claim.job_id, claim.step_id
    t1 = time.perf_counter()
    progress: list[Progress] = []
    try:
        ran = _run_claimed(claim, jobs, settings)
        result, progress = ran.result, ran.progress
    except KilnError as exc:  # e.g. the store is unreachable in a way that is the user's problem
        result = ChildResult(ok=False, error=exc.to_dict())
    except Exception:
        # A transient failure around the step (database, broker, store): hand the step back
        # so the retried task can claim it again, then let Celery retry. (A continued step
        # has no message of its own: the release re-enqueues it.)
        try:
            if jobs.release_step(job_id, step_id, claim.attempt, "transient error in the worker"):
                enqueue_steps(celery_app, job_id, [(step_id, claim.step["engine"])])
        except Exception:
            log.warning("could not release %s/%s; the stale-step sweep will", job_id, step_id)
        raise
    t2 = time.perf_counter()
    if result.lost:
        log.warning("step %s of job %s was taken over by another worker; dropping this run", step_id, job_id)
        return StepRun(job_id, step_id, "lost"), None
    if result.ok:
        status = "succeeded"
    elif (result.error or {}).get("code") == "CANCELLED":
        status = "cancelled"
    else:
        status = "failed"
    advance = jobs.finish_step(
        job_id,
        step_id,
        claim.attempt,
        status=status,
        seconds=result.seconds,
        artifact_key=result.key,
        cached=result.cached,
        meta=result.meta or None,
        error=result.error,
        log=result.log or None,
        continue_on=engines,
        worker=worker_name(),
        progress=progress,
    )
    if advance is None:
        return StepRun(job_id, step_id, "lost"), None
    t3 = time.perf_counter()
    enqueue_steps(celery_app, job_id, advance.queued)
    timings = {
        "claim": claim_ms,
        "run": (t2 - t1) * 1000,
        "step": result.seconds * 1000,
        "record": (t3 - t2) * 1000,
        "enqueue": (time.perf_counter() - t3) * 1000,
    }
    return StepRun(job_id, step_id, status, cached=result.cached, timings=timings), advance.claimed


@cache
def _job_store(url: str) -> StepScheduler:
    return StepScheduler(url)
