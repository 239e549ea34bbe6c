"""The job store: jobs, their steps and events, API tokens, sessions, model names, idempotency keys and live workers, in SQL.

SQLAlchemy 2 models with Alembic migrations; SQLite by default (embedded), PostgreSQL in
production. The store is the service's source of truth: the broker carries only
``(job_id, step_id)``, and every state change is a guarded UPDATE so a redelivered message
cannot run or publish twice. One store per concern, on one shared database
(services.jobs.database): ``JobStore`` (jobs and their events), ``StepScheduler`` (claiming,
recording and advancing steps), ``WorkerRegistry``, ``TokenStore``, ``SessionStore``,
``ModelNames`` and ``IdempotencyKeys``; ``JobStores`` opens them together.

Names are imported lazily: step children import ``services.jobs.backends`` and must not
pay for SQLAlchemy.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ApiToken",
    "IdempotencyKeys",
    "Job",
    "JobDatabase",
    "JobEvent",
    "JobStep",
    "JobStore",
    "JobStores",
    "ModelNames",
    "SessionStore",
    "StepScheduler",
    "TokenStore",
    "WorkerRecord",
    "WorkerRegistry",
    "database_url",
    "get_engine",
    "upgrade",
]

_WHERE = {
    "ApiToken": "services.jobs.models",
    "IdempotencyKeys": "services.jobs.idempotency",
    "Job": "services.jobs.models",
    "JobEvent": "services.jobs.models",
    "JobStep": "services.jobs.models",
    "WorkerRecord": "services.jobs.models",
    "JobStore": "services.jobs.store",
    "JobDatabase": "services.jobs.database",
    "JobStores": "services.jobs.stores",
    "ModelNames": "services.jobs.model_names",
    "SessionStore": "services.jobs.sessions",
    "StepScheduler": "services.jobs.scheduling",
    "TokenStore": "services.jobs.tokens",
    "WorkerRegistry": "services.jobs.worker_registry",
    "database_url": "services.jobs.db",
    "get_engine": "services.jobs.db",
    "upgrade": "services.jobs.migrate",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'services.jobs' has no attribute {name!r}")
