"""Fair sharing between tenants: how many jobs one tenant may have running, and waiting to start.

Two quotas per tenant, from the settings (``KILN_TENANT_MAX_RUNNING_JOBS``,
``KILN_TENANT_MAX_QUEUED_JOBS``) unless the submitting token carries its own:

- **queued**: jobs accepted but not started. A submission past it is refused with 429
  QUOTA_EXCEEDED, in the transaction that would record the job, so nothing is stored;
- **running**: jobs started and not finished. A job's first step is not claimed while its
  tenant runs that many jobs: the worker hands the delivery back to the queue for a moment
  (:data:`DEFER_SECONDS`) and takes the next one, another tenant's. The limit a job runs under
  is the one its token had at submission (``jobs.max_running``).

Both counts are taken under a per-tenant lock on PostgreSQL (a transaction-scoped advisory
lock), so two submissions or two claims racing for a tenant's last place cannot both get it;
SQLite runs one writer at a time anyway. The third rule, that one tenant's steps never hold
every step slot of a worker, is the worker's own (workers/slots.py).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from services.errors import QuotaExceeded
from services.jobs.database import JobDatabase, job_database
from services.jobs.models import Job

__all__ = ["DEFER_SECONDS", "QUOTA_DESCRIPTION", "QuotaStore", "TenantQuota", "TenantUsage", "lock_tenant"]

#: The 429 answer, as the routes that record jobs document it.
QUOTA_DESCRIPTION = (
    "QUOTA_EXCEEDED: the tenant has as many jobs waiting to start as its quota allows (details: queued, "
    "max_queued, running, max_running; GET /quota)"
)
#: How long a job's first step waits in the queue before it asks again for a place to run.
DEFER_SECONDS = 2.0


@dataclass(frozen=True)
class TenantQuota:
    """The limits one caller's jobs run under."""

    max_running: int
    max_queued: int

    @classmethod
    def of(cls, settings: object, running: int | None = None, queued: int | None = None) -> TenantQuota:
        """Return the quota of a token with its own ``running``/``queued`` limits (None: the settings')."""
        return cls(
            max_running=running or int(settings.tenant_max_running_jobs),  # type: ignore[attr-defined]
            max_queued=queued or int(settings.tenant_max_queued_jobs),  # type: ignore[attr-defined]
        )


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's jobs now: running and waiting to start."""

    tenant: str
    running: int
    queued: int


def lock_tenant(db: JobDatabase, s: Session, tenant: str) -> None:
    """Serialise, until ``s`` commits, every transaction counting ``tenant``'s jobs (PostgreSQL; SQLite has one writer)."""
    if db.pg:
        s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": zlib.crc32(f"kiln-tenant:{tenant}".encode())})


def count_jobs(s: Session, tenant: str, status: str) -> int:
    return int(s.scalar(select(func.count()).select_from(Job).where(Job.tenant == tenant, Job.status == status)) or 0)


def check_queued(s: Session, tenant: str, quota: TenantQuota) -> None:
    """Refuse (QUOTA_EXCEEDED) a new job of ``tenant`` when it already has ``quota.max_queued`` waiting."""
    queued = count_jobs(s, tenant, "queued")
    if queued >= quota.max_queued:
        raise QuotaExceeded(
            f"tenant {tenant} has {queued} jobs waiting to start, its quota is {quota.max_queued}",
            tenant=tenant,
            queued=queued,
            max_queued=quota.max_queued,
            running=count_jobs(s, tenant, "running"),
            max_running=quota.max_running,
        )


def may_start(s: Session, job: Job, default_max_running: int) -> bool:
    """Return whether ``job`` (queued) may start now: its tenant runs fewer jobs than the job's running quota."""
    limit = job.max_running or default_max_running
    return count_jobs(s, job.tenant, "running") < limit


class QuotaStore:
    """Reads of tenants' usage on one database (GET /quota, the dashboard)."""

    def __init__(self, db: JobDatabase | str) -> None:
        self.db = job_database(db)

    def usage(self, tenant: str) -> TenantUsage:
        with self.db.read() as s:
            return TenantUsage(tenant, count_jobs(s, tenant, "running"), count_jobs(s, tenant, "queued"))
