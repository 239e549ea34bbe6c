"""Throttle the dashboard's sign-in per client: a few wrong tokens, then a wait.

Tokens are 256 random bits, so guessing one is hopeless; what an unthrottled sign-in form
gives away is the API's time (each attempt is a database read) and a cheap way to check a
list of stolen tokens. After :attr:`LoginThrottle.max_failures` failed sign-ins within
:attr:`LoginThrottle.window` seconds, a client (its address: the peer, or what a trusted proxy
says in X-Forwarded-For) is answered 429 without a lookup until the oldest failure ages out.
A right token clears its record. The counts live in each API process; memory is bounded
(the least recently seen clients are forgotten first).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque

__all__ = ["LoginThrottle"]


class LoginThrottle:
    """Failed sign-ins per client address within a sliding window."""

    def __init__(self, max_failures: int = 5, window: float = 60.0, max_clients: int = 10_000) -> None:
        self.max_failures, self.window, self.max_clients = max_failures, window, max_clients
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def _recent(self, client: str, now: float) -> deque[float]:
        times = self._failures.get(client)
        if times is None:
            return deque()
        while times and now - times[0] >= self.window:
            times.popleft()
        return times

    def retry_after(self, client: str) -> float:
        """Return the seconds ``client`` must wait before its next sign-in is even looked at (0: it may try now)."""
        now = time.monotonic()
        with self._lock:
            times = self._recent(client, now)
            if len(times) < self.max_failures:
                return 0.0
            return max(self.window - (now - times[0]), 0.0)

    def failed(self, client: str) -> None:
        now = time.monotonic()
        with self._lock:
            times = self._recent(client, now)
            times.append(now)
            self._failures[client] = times
            self._failures.move_to_end(client)
            while len(self._failures) > self.max_clients:
                self._failures.popitem(last=False)

    def succeeded(self, client: str) -> None:
        with self._lock:
            self._failures.pop(client, None)
