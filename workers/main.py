"""Start a worker process: probe engines, migrate SQLite, run Celery on the engines' queues."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

from services.graph.engines import queue_name
from services.jobs.db import database_url
from services.jobs.migrate import upgrade
from services.jobs.stores import JobStores
from services.settings import Settings
from workers import child
from workers.app import create_celery_app
from workers.maintenance import Maintenance
from workers.probe import engine_versions, resolve_served
from workers.slots import slots

__all__ = ["run_worker", "worker_argv"]

log = logging.getLogger("kiln.worker")


def worker_argv(engines: list[str], concurrency: int, hostname: str, loglevel: str) -> list[str]:
    """Return the `celery worker` arguments for serving ``engines``."""
    return [
        "worker",
        "--queues",
        ",".join(queue_name(e) for e in engines),
        "--concurrency",
        str(concurrency),
        # Threads: each task only supervises its step's child process (workers.child), which
        # is where conversions run and crash; a thread pool keeps one forkserver per worker
        # and keeps multiprocessing out of Celery's daemonic prefork processes.
        "--pool",
        "threads",
        "--hostname",
        hostname,
        "--loglevel",
        loglevel,
        # Cluster chatter is not needed: liveness lives in the job store.
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]


def run_worker(
    settings: Settings, engines: list[str] | tuple[str, ...] = (), concurrency: int = 1, loglevel: str = "INFO"
) -> None:
    """Serve the queues of ``engines`` (default: every engine installed here) until stopped.

    Raises ENGINE_UNAVAILABLE before touching the broker when an engine's SDK is missing.
    """
    from celery import signals

    loaded, served = resolve_served(list(engines))
    url = database_url(settings)
    if url.startswith("sqlite"):
        upgrade(url)
    app = create_celery_app(settings)
    child.configure(loaded, settings)
    hostname = f"kiln-{'+'.join(served)}-{os.getpid()}@{socket.gethostname()}"
    app.conf.kiln_engines = tuple(served)  # lets a task run the next step of a chain itself
    slots.configure(concurrency, shared=settings.auth_enabled)  # tenants share it: keep a slot free (workers/slots.py)
    # One line on what protects the host from the models this worker runs (docs/security.md).
    print(child.protection(settings).summary(), file=sys.stderr, flush=True)
    stores = JobStores.open(url)
    maintenance = Maintenance(
        stores.steps,
        stores.workers,
        app,
        settings,
        hostname=hostname,
        engines=served,
        versions=engine_versions(loaded),
        concurrency=concurrency,
    )

    @signals.worker_ready.connect(weak=False)
    def _ready(**_: Any) -> None:
        # Start the step forkserver now (it imports the engines), not on the first step.
        import multiprocessing.forkserver

        multiprocessing.forkserver.ensure_running()
        maintenance.beat()
        maintenance.start()
        log.info("kiln worker %s serving %s", hostname, ", ".join(queue_name(e) for e in served))

    @signals.worker_shutdown.connect(weak=False)
    def _shutdown(**_: Any) -> None:
        maintenance.stop()
        child.shutdown_children()  # idle step children would otherwise wait out their idle limit

    app.worker_main(worker_argv(served, concurrency, hostname, loglevel))
