"""What keeps polling GET /jobs/{id} and the event streams cheap: cached bodies and batched version reads.

Pipelines poll a job until it ends. A job's version is its newest event id (every change
its view shows is recorded with an event, in commit order: services.jobs.store), so:

- a serialized body is kept per job with the version it shows, and served again while the
  version is unchanged; a finished job's body is final and served without any read;
- the versions themselves are read in rounds: every request waiting when a round starts
  is answered by that round's one query, whatever the number of requests and jobs. A
  request only joins a round that has not started yet, so the version it gets was read
  after it arrived: never older than a request-per-query read would have been.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from services.jobs.models import DEFAULT_TENANT
from services.jobs.store import JobVersion

__all__ = ["CachedBody", "JobBodies", "JobVersions"]


@dataclass(frozen=True)
class CachedBody:
    """A job's serialized public view and the version it shows."""

    version: int
    final: bool  # the job ended and no step is still being stopped: it never changes again
    body: bytes
    tenant: str = DEFAULT_TENANT  # whose job: checked before a cached body is served

    @property
    def etag(self) -> str:
        return f'"{self.version}"'


class JobBodies:
    """Serialized job views, keyed by job id (least recently used ones dropped)."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._items: OrderedDict[str, CachedBody] = OrderedDict()
        self._lock = threading.Lock()  # put() runs in worker threads

    def get(self, job_id: str) -> CachedBody | None:
        with self._lock:
            item = self._items.get(job_id)
            if item is not None:
                self._items.move_to_end(job_id)
            return item

    def put(self, job_id: str, item: CachedBody) -> None:
        with self._lock:
            old = self._items.get(job_id)
            if old is not None and old.version > item.version:
                return  # a slower rebuild must not replace a newer body
            self._items[job_id] = item
            self._items.move_to_end(job_id)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


class JobVersions:
    """Reads job versions for concurrent requests in rounds of one query each (see the module doc)."""

    def __init__(self, read: Callable[[Collection[str]], dict[str, JobVersion]]) -> None:
        self._read = read
        self._loop: asyncio.AbstractEventLoop | None = None
        # Each waiter has its own future: one that goes away cancels only its own.
        self._next: dict[str, list[asyncio.Future[JobVersion | None]]] = {}
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0  # queries run (for tests and benchmarks)

    async def get(self, job_id: str) -> JobVersion | None:
        """Return the job's version and status read after this call began; None for an unknown job."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (tests start several): nothing carries over
            self._loop, self._next, self._task = loop, {}, None
        fut: asyncio.Future[JobVersion | None] = loop.create_future()
        self._next.setdefault(job_id, []).append(fut)
        if self._task is None:
            self._task = loop.create_task(self._rounds())
        return await fut

    async def _rounds(self) -> None:
        try:
            while self._next:
                batch, self._next = self._next, {}
                self.rounds += 1
                try:
                    found = await run_in_threadpool(self._read, list(batch))
                except Exception as exc:  # e.g. the database is down: every waiter gets the error
                    for futs in batch.values():
                        for fut in futs:
                            if not fut.done():
                                fut.set_exception(exc)
                    continue
                for job_id, futs in batch.items():
                    seen = found.get(job_id)
                    for fut in futs:
                        if not fut.done():
                            fut.set_result(seen)
        finally:
            self._task = None
