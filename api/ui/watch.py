"""One poller per process for every job a dashboard page follows.

An open job page waits here instead of polling: a single task reads the versions of all
watched jobs once per tick (one query, api.polling.JobVersions) and wakes only the pages
whose job moved. 200 open pages then cost one query and one wake-up per tick, not 200
(docs/benchmarks.md, "Web dashboard").
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from api.polling import JobVersions
from services.jobs.store import JobVersion

__all__ = ["JobWatch", "job_watch"]

#: Seconds between version reads for the open pages: people, not pipelines, are waiting.
TICK = 0.25
_FINAL = ("succeeded", "failed", "cancelled")


class JobWatch:
    """Waiters per job id, woken when the job's version passes what they show or the job ends."""

    def __init__(self, versions: JobVersions, tick: float = TICK) -> None:
        self.versions, self.tick = versions, tick
        self._waiters: dict[str, list[tuple[int, asyncio.Future[JobVersion | None]]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def wait(self, job_id: str, shown: int, timeout: float) -> JobVersion | None:
        """Return the job's version once it is newer than ``shown`` or the job is final.

        None when the job is gone; raises TimeoutError after ``timeout`` seconds of no change.
        """
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (tests start several): nothing carries over
            self._loop, self._waiters, self._task = loop, {}, None
        fut: asyncio.Future[JobVersion | None] = loop.create_future()
        entry = (shown, fut)
        self._waiters.setdefault(job_id, []).append(entry)
        if self._task is None:
            self._task = loop.create_task(self._run())
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            waiting = self._waiters.get(job_id, [])
            with contextlib.suppress(ValueError):
                waiting.remove(entry)
            if not waiting:
                self._waiters.pop(job_id, None)

    async def _run(self) -> None:
        try:
            while self._waiters:
                jobs = list(self._waiters)
                try:
                    seen = await asyncio.gather(*(self.versions.get(j) for j in jobs))
                except Exception as exc:  # the database is down: every waiter gets the error
                    for entries in list(self._waiters.values()):
                        for _, fut in entries:
                            if not fut.done():
                                fut.set_exception(exc)
                    await asyncio.sleep(self.tick)
                    continue
                for job_id, version in zip(jobs, seen, strict=True):
                    for shown, fut in list(self._waiters.get(job_id, [])):
                        moved = version is None or version.version > shown or version.status in _FINAL
                        if moved and not fut.done():
                            fut.set_result(version)
                await asyncio.sleep(self.tick)
        finally:
            self._task = None


def job_watch(state: Any) -> JobWatch:
    """Return the app's watcher, made on first use (it needs the app's JobVersions)."""
    watch = getattr(state, "ui_job_watch", None)
    if watch is None:
        watch = state.ui_job_watch = JobWatch(state.job_versions)
    return watch  # type: ignore[no-any-return]
