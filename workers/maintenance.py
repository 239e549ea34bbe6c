"""A worker's housekeeping thread: its own heartbeat in the job store, and the stale-step sweep.

Any live worker requeues steps whose worker stopped heartbeating (SIGKILL, OOM, a lost
node), so a job survives the death of the worker running it without waiting for the
broker's visibility timeout.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from services.jobs.scheduling import StepScheduler
from services.jobs.worker_registry import WorkerRegistry
from services.settings import Settings
from workers.queues import enqueue_steps

__all__ = ["Maintenance", "fail_unserved_once", "sweep_once", "worker_max_age"]

log = logging.getLogger("kiln.worker")

#: A queued step whose message may have been lost is re-announced after this many stale periods.
LOST_FACTOR = 5


def worker_max_age(settings: Settings) -> float:
    """Return how recent a worker's heartbeat must be for it to count as live."""
    return max(3 * settings.step_heartbeat_interval, 15.0)


def sweep_once(steps: StepScheduler, workers: WorkerRegistry, celery_app: Any, settings: Settings) -> int:
    """Requeue stale running steps, re-announce long-queued ones, fail unserved ones; return how many."""
    found = steps.requeue_stale(settings.step_stale_after, settings.step_stale_after * LOST_FACTOR)
    for job_id, step_id, engine in found:
        log.warning("requeueing step %s of job %s", step_id, job_id)
        enqueue_steps(celery_app, job_id, [(step_id, engine)])
    return len(found) + fail_unserved_once(steps, workers, celery_app, settings)


def fail_unserved_once(steps: StepScheduler, workers: WorkerRegistry, celery_app: Any, settings: Settings) -> int:
    """Fail steps that waited KILN_WORKER_WAIT_SECONDS for an engine with no live worker; return how many moved on."""
    live = {e for w in workers.live_workers(worker_max_age(settings)) for e in w.engines}
    ready = steps.fail_unserved(live, settings.worker_wait_seconds)
    for job_id, step_id, engine in ready:
        enqueue_steps(celery_app, job_id, [(step_id, engine)])
    return len(ready)


class Maintenance(threading.Thread):
    """Heartbeats this worker and sweeps stale steps until stopped."""

    def __init__(
        self,
        steps: StepScheduler,
        workers: WorkerRegistry,
        celery_app: Any,
        settings: Settings,
        *,
        hostname: str,
        engines: list[str],
        versions: dict[str, Any],
        concurrency: int,
    ) -> None:
        super().__init__(name="kiln-maintenance", daemon=True)
        self.steps, self.workers, self.app, self.settings = steps, workers, celery_app, settings
        self.hostname, self.engines, self.versions, self.concurrency = hostname, engines, versions, concurrency
        self._stop_event = threading.Event()

    def beat(self) -> None:
        self.workers.worker_heartbeat(
            self.hostname, engines=self.engines, versions=self.versions, pid=os.getpid(), concurrency=self.concurrency
        )

    def run(self) -> None:
        interval = self.settings.step_heartbeat_interval
        while not self._stop_event.is_set():
            try:
                self.beat()
                sweep_once(self.steps, self.workers, self.app, self.settings)
            except Exception:  # a database or broker blip must not kill the thread
                log.warning("maintenance pass failed", exc_info=True)
            self._stop_event.wait(interval)

    def stop(self) -> None:
        self._stop_event.set()
        try:
            self.workers.worker_stopped(self.hostname)
        except Exception:
            log.warning("could not mark worker %s stopped", self.hostname, exc_info=True)
