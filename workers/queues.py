"""Task names and queues per engine, and enqueueing steps: the one place the API and tasks publish.

Queue names come from services.graph.engines (``kiln.<engine>``); each engine has its own
task name routed to its own queue, so a worker serving only some engines never receives
another engine's step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from services.graph.engines import ENGINES, queue_name

__all__ = ["PUBLISH_RETRY", "all_queues", "enqueue_steps", "task_name"]

#: Bounded retries when publishing: a broker outage surfaces quickly (the API answers 503).
PUBLISH_RETRY = {"max_retries": 3, "interval_start": 0.0, "interval_step": 0.5, "interval_max": 1.0}


def task_name(engine: str) -> str:
    """Return the Celery task name that runs ``engine``'s steps."""
    return f"kiln.step.{engine}"


def all_queues() -> list[str]:
    """Return every engine queue, in ENGINES order."""
    return [queue_name(e) for e in ENGINES]


def enqueue_steps(celery_app: Any, job_id: str, steps: Iterable[tuple[str, str]]) -> None:
    """Send ``(job_id, step_id)`` for each ``(step_id, engine)`` to that engine's queue."""
    for step_id, engine in steps:
        celery_app.send_task(
            task_name(engine),
            args=[job_id, step_id],
            queue=queue_name(engine),
            routing_key=queue_name(engine),
            retry=True,
            retry_policy=PUBLISH_RETRY,
        )
