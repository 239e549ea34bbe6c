"""Ready means ready: what `kiln serve`'s own workers are doing, for /readyz and for admitting jobs.

`kiln serve` starts one worker process for the engines installed here. Until it has
registered (its first heartbeat in the job store), its engines are *starting*: /readyz
answers 503 ``starting`` naming them, and a job needing them is accepted and waits in its
queue instead of being refused with ENGINE_UNAVAILABLE. Both are bounded: an engine still
missing ``start_seconds`` after the worker's last (re)start is *not started*, which
/readyz reports as unavailable and admission refuses as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterable

__all__ = ["EmbeddedWorkers"]


class EmbeddedWorkers:
    """The in-process workers of `kiln serve`: their engines and when they were last (re)started."""

    def __init__(self, engines: Iterable[str], start_seconds: float) -> None:
        self.engines = tuple(engines)
        self.start_seconds = start_seconds
        self._lock = threading.Lock()
        self._started_at = time.monotonic()

    def started(self) -> None:
        """Note a (re)start of the worker process: its engines are starting again."""
        with self._lock:
            self._started_at = time.monotonic()

    def _within_bound(self) -> bool:
        with self._lock:
            return time.monotonic() - self._started_at < self.start_seconds

    def starting(self, live: Collection[str]) -> list[str]:
        """Return the engines without a live worker yet that are still within their start bound."""
        missing = [e for e in self.engines if e not in live]
        return missing if missing and self._within_bound() else []

    def verdict(self, live: Collection[str]) -> str:
        """Return /readyz's ``workers`` check: "ok", "starting: <engines>" or what did not start."""
        missing = [e for e in self.engines if e not in live]
        if not missing:
            return "ok"
        if self._within_bound():
            return "starting: " + ", ".join(missing)
        return f"not started within {self.start_seconds:g} s: " + ", ".join(missing)
