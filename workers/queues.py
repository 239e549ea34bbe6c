"""Task names and queues per engine, and enqueueing steps: the one place the API and tasks publish.

Queue names come from services.graph.engines (``kiln.<engine>``); each engine has its own
task name routed to its own queue, so a worker serving only some engines never receives
another engine's step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from services.graph.engines import ENGINES, queue_name
from services.tune.plan import TUNE_ENGINE
from services.tune.space import TUNABLE_TARGETS

__all__ = [
    "PUBLISH_RETRY",
    "all_queues",
    "enqueue_steps",
    "queue_engines",
    "serves_tune",
    "task_name",
    "tunable_engines",
]

#: Bounded retries when publishing: a broker outage surfaces quickly (the API answers 503).
PUBLISH_RETRY = {"max_retries": 3, "interval_start": 0.0, "interval_step": 0.5, "interval_max": 1.0}


def task_name(engine: str) -> str:
    """Return the Celery task name that runs ``engine``'s steps."""
    return f"kiln.step.{engine}"


def queue_engines() -> list[str]:
    """Return every name with a queue and a step task: each engine, and ``tune`` (services/tune/plan.py)."""
    return [*ENGINES, TUNE_ENGINE]


def all_queues() -> list[str]:
    """Return every engine queue, in ENGINES order."""
    return [queue_name(e) for e in ENGINES]


def serves_tune(engines: Iterable[str]) -> bool:
    """Return True when a worker serving ``engines`` takes tune jobs: it runs two tunable engines or more.

    A tune compares engines side by side in one process, so a worker that runs only one of them
    leaves tune jobs to a worker that runs several (`kiln serve`'s, or an all-engine image).
    """
    return len(set(tunable_engines()) & {e.split("-")[0] for e in engines}) >= 2


def tunable_engines() -> list[str]:
    """Return the engines of the targets a tune has settings grids for (onnxruntime, openvino, tensorflow)."""
    from services.descriptors import registry

    targets = registry().targets
    return list(dict.fromkeys(targets[t].engine for t in TUNABLE_TARGETS if t in targets))


def enqueue_steps(
    celery_app: Any, job_id: str, steps: Iterable[tuple[str, str]], *, countdown: float | None = None
) -> None:
    """Send ``(job_id, step_id)`` for each ``(step_id, engine)`` to that engine's queue (due in ``countdown`` s)."""
    for step_id, engine in steps:
        celery_app.send_task(
            task_name(engine),
            args=[job_id, step_id],
            queue=queue_name(engine),
            routing_key=queue_name(engine),
            retry=True,
            retry_policy=PUBLISH_RETRY,
            countdown=countdown,
        )
