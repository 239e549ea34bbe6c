"""The live workers: each worker process's record, refreshed by its heartbeat, and the engines it serves."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import select, update

from services.jobs.database import JobDatabase, job_database
from services.jobs.models import WorkerRecord, utcnow

__all__ = ["WorkerRegistry"]


class WorkerRegistry:
    """Worker records on one database."""

    def __init__(self, db: JobDatabase | str) -> None:
        self.db = job_database(db)

    def worker_heartbeat(
        self, hostname: str, *, engines: list[str], versions: dict[str, Any], pid: int, concurrency: int
    ) -> None:
        """Insert or refresh a worker's record."""
        now = utcnow()
        with self.db.write() as s:
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
        with self.db.write() as s:
            s.execute(update(WorkerRecord).where(WorkerRecord.hostname == hostname).values(stopped_at=utcnow()))

    def live_workers(self, max_age: float) -> list[WorkerRecord]:
        """Return workers that heartbeated within ``max_age`` seconds and did not stop."""
        cutoff = utcnow() - timedelta(seconds=max_age)
        with self.db.read() as s:
            return list(
                s.scalars(
                    select(WorkerRecord)
                    .where(WorkerRecord.heartbeat_at >= cutoff, WorkerRecord.stopped_at.is_(None))
                    .order_by(WorkerRecord.hostname)
                ).all()
            )
