"""The Celery app factory: broker, queues, reliability settings and one step task per engine.

Redis in production; with no KILN_BROKER_URL, kombu's filesystem transport under the cache
dir, so `kiln serve` needs no server and still runs these very tasks.
"""

from __future__ import annotations

import logging
from typing import Any

from services.graph.engines import queue_name
from services.settings import Settings, get_settings
from workers.broker import TRANSPORT as EMBEDDED_TRANSPORT
from workers.queues import queue_engines, task_name

__all__ = ["TRANSIENT_ERRORS", "broker_settings", "create_celery_app"]

log = logging.getLogger("kiln.worker")


def _transient_errors() -> tuple[type[BaseException], ...]:
    """Errors worth retrying: the database, the broker or the network blinked."""
    import kombu.exceptions
    import sqlalchemy.exc

    errors: list[type[BaseException]] = [
        sqlalchemy.exc.OperationalError,
        sqlalchemy.exc.InterfaceError,
        kombu.exceptions.OperationalError,
        ConnectionError,
        TimeoutError,
    ]
    try:
        import redis.exceptions

        errors += [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError]
    except ImportError:
        pass
    try:
        import botocore.exceptions

        errors += [botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError]
    except ImportError:
        pass
    return tuple(errors)


TRANSIENT_ERRORS = _transient_errors()


def broker_settings(settings: Settings) -> tuple[str, dict[str, Any]]:
    """Return the broker URL and its transport options (the embedded broker's transport: broker_transport)."""
    if settings.broker_url:
        # Redis redelivers an unacknowledged message only after the visibility timeout, so it
        # must outlast the longest step; a worker that dies is noticed sooner by the job
        # store's heartbeat sweep (step_stale_after).
        return settings.broker_url, {
            "visibility_timeout": settings.step_hard_time_limit + 600,
            "socket_timeout": 10,
            "socket_connect_timeout": 5,
        }
    root = settings.cache_dir / "broker"
    for sub in ("queue", "control"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    return "filesystem://", {
        "data_folder_in": str(root / "queue"),
        "data_folder_out": str(root / "queue"),
        "control_folder": str(root / "control"),
        # Each empty poll lists one directory; 20 ms keeps a step hop short for pennies of CPU.
        "polling_interval": 0.02,
    }


def create_celery_app(settings: Settings | None = None) -> Any:
    """Return a Celery app for ``settings`` with every engine's step task registered."""
    from celery import Celery
    from kombu import Queue

    settings = settings or get_settings()
    url, transport_options = broker_settings(settings)
    app = Celery("kiln", set_as_current=False)
    app.conf.update(
        broker_url=url,
        # The embedded broker is kombu's filesystem transport with atomic message writes.
        broker_transport=None if settings.broker_url else EMBEDDED_TRANSPORT,
        broker_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=5,
        # The job store is the only record of results: no result backend.
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
        task_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_queues=[Queue(queue_name(e), routing_key=queue_name(e)) for e in queue_engines()],
        task_routes={task_name(e): {"queue": queue_name(e), "routing_key": queue_name(e)} for e in queue_engines()},
        task_default_queue=queue_name("onnxruntime"),
        task_create_missing_queues=False,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        worker_disable_rate_limits=True,
    )
    app.conf.kiln_settings = settings
    for name in queue_engines():
        _register_step_task(app, name, settings)
    return app


def _register_step_task(app: Any, engine: str, settings: Settings) -> None:
    # The task process's own limits sit above the step's: the child runner enforces the
    # step limits (and records TIMEOUT); these only catch a task stuck outside the child.
    @app.task(
        name=task_name(engine),
        shared=False,  # belongs to this app only (tests build several apps in one process)
        bind=True,
        queue=queue_name(engine),
        acks_late=True,
        reject_on_worker_lost=True,
        soft_time_limit=settings.step_hard_time_limit + 60,
        time_limit=settings.step_hard_time_limit + 120,
        autoretry_for=TRANSIENT_ERRORS,
        retry_backoff=True,
        retry_backoff_max=60,
        retry_jitter=True,
        max_retries=8,
    )
    def run_step_task(self: Any, job_id: str, step_id: str) -> dict[str, Any]:
        # kiln_engines: what this worker serves (set by workers.main); the API's app has none.
        from workers.tasks import execute_step

        runs = execute_step(
            job_id,
            step_id,
            settings=self.app.conf.kiln_settings,
            celery_app=self.app,
            engines=self.app.conf.get("kiln_engines", ()),
        )
        for run in runs:
            times = " ".join(f"{k} {v:.0f}ms" for k, v in run.timings.items())
            log.info(
                "job %s step %s: %s%s %s", job_id, run.step_id, run.outcome, " (cached)" if run.cached else "", times
            )
        return {"runs": [run.to_dict() for run in runs]}
