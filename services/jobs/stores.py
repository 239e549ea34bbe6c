"""Every store of one job database, opened together (what the API holds; workers take the ones they use)."""

from __future__ import annotations

from dataclasses import dataclass

from services.jobs.database import JobDatabase, job_database
from services.jobs.idempotency import IdempotencyKeys
from services.jobs.model_names import ModelNames
from services.jobs.scheduling import StepScheduler
from services.jobs.sessions import SessionStore
from services.jobs.store import JobStore
from services.jobs.tokens import TokenStore
from services.jobs.webhooks import WebhookStore
from services.jobs.worker_registry import WorkerRegistry

__all__ = ["JobStores"]


@dataclass(frozen=True)
class JobStores:
    """The stores of one database, one concern each, sharing its engine and plan cache."""

    db: JobDatabase
    jobs: JobStore
    steps: StepScheduler
    workers: WorkerRegistry
    tokens: TokenStore
    sessions: SessionStore
    model_names: ModelNames
    idempotency: IdempotencyKeys
    webhooks: WebhookStore

    @classmethod
    def open(cls, where: JobDatabase | str) -> JobStores:
        db = job_database(where)
        return cls(
            db=db,
            jobs=JobStore(db),
            steps=StepScheduler(db),
            workers=WorkerRegistry(db),
            tokens=TokenStore(db),
            sessions=SessionStore(db),
            model_names=ModelNames(db),
            idempotency=IdempotencyKeys(db),
            webhooks=WebhookStore(db),
        )
