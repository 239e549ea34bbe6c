#!/usr/bin/env python3
"""Container health of a Kiln worker: exit 0 when a worker in this container is heartbeating.

A worker's housekeeping thread refreshes its record in the job store every few seconds
(workers/maintenance.py); the record is named ``...@<hostname>``, and a container's (or a
pod's) hostname is its own. So a fresh record proves that the worker process lives, finished
starting and reaches the database, without a broker round trip per probe. Installed in the
worker images as /opt/kiln/bin/kiln-worker-healthcheck; compose.yaml and the Helm chart call it.
"""

from __future__ import annotations

import socket
import sys

__all__ = ["main"]


def main() -> int:
    from services.jobs.db import database_url
    from services.jobs.worker_registry import WorkerRegistry
    from services.settings import get_settings

    settings = get_settings()
    # Several missed beats, not one: a busy database must not get a healthy worker restarted.
    max_age = max(30.0, 6 * settings.step_heartbeat_interval)
    suffix = "@" + socket.gethostname()
    try:
        live = WorkerRegistry(database_url(settings)).live_workers(max_age)
    except Exception as exc:  # the probe reports, it never raises
        print(f"unhealthy: job store unreachable: {type(exc).__name__}: {exc}"[:300])
        return 1
    mine = [w for w in live if w.hostname.endswith(suffix)]
    if not mine:
        print(f"unhealthy: no worker on {suffix[1:]} heartbeated in the last {max_age:.0f}s")
        return 1
    print("healthy: " + ", ".join(f"{w.hostname} ({', '.join(w.engines)})" for w in mine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
