"""A worker's step slots by tenant: one tenant's steps never take the last free slot.

A worker runs ``--concurrency`` steps at once. Without a rule, one tenant's steps could hold
every slot (a slow model, or one that hangs until its step's time limit) and another
tenant's one-second job would wait behind them. So, on a worker with several slots and
tenants to share them (auth on), a tenant already running steps here may not take the last
free slot: its delivery goes back to the queue for a moment (services/jobs/quotas.py's
DEFER_SECONDS) and the slot stays for someone else. A tenant alone on the worker still runs
``concurrency - 1`` steps at once; one slot means no reservation (then the step time limit and
the reaping of hung children, workers/child.py, bound the wait).
"""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["TenantSlots", "slots"]


class TenantSlots:
    """Counts this worker's running steps per tenant and says whether another may start."""

    def __init__(self) -> None:
        self.capacity = 0  # 0: no reservation (a single slot, auth off, or not configured)
        self._running: Counter[str] = Counter()
        self._lock = threading.Lock()

    def configure(self, concurrency: int, shared: bool) -> None:
        """Reserve for others on a worker of ``concurrency`` slots whose tenants are ``shared`` (auth on)."""
        self.capacity = concurrency if shared and concurrency > 1 else 0

    @property
    def active(self) -> bool:
        return self.capacity > 0

    def take(self, tenant: str) -> bool:
        """Count a step of ``tenant`` as running here, unless it would take the last free slot; return whether it may."""
        with self._lock:
            busy = sum(self._running.values())
            if self.capacity and self._running[tenant] and busy >= self.capacity - 1:
                return False
            self._running[tenant] += 1
            return True

    def give_back(self, tenant: str) -> None:
        with self._lock:
            self._running[tenant] -= 1
            if self._running[tenant] <= 0:
                del self._running[tenant]

    def running(self) -> dict[str, int]:
        with self._lock:
            return dict(self._running)


#: This worker process's slots (configured by workers/main.py).
slots = TenantSlots()
