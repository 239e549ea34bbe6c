"""Idempotent submits: a tenant's ``Idempotency-Key`` names one request and the job it made, for a day.

A pipeline that retries a submit after a dropped connection sends the same key with the
same request: it gets the job the first attempt made, not a second one. The key is claimed
in the transaction that records the job, so of two attempts racing with one key exactly one
records a job; the other answers with that job. Keys belong to the submitting token's
tenant: another tenant's key of the same spelling is another key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from services.errors import IdempotencyKeyReused
from services.jobs.database import JobDatabase, job_database
from services.jobs.models import IdempotencyKey, utcnow

__all__ = ["KEY_LIFETIME", "IdempotencyClaim", "IdempotencyKeys", "KeyTaken", "KnownKey", "claim_key", "fingerprint"]

#: How long a key names its request: a retry within this answers the first job.
KEY_LIFETIME = timedelta(hours=24)


def fingerprint(**request: Any) -> str:
    """Return the sha256 of a request's canonical JSON (what decides "the same request")."""
    return hashlib.sha256(json.dumps(request, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


@dataclass(frozen=True)
class IdempotencyClaim:
    """A submit's key and its request's fingerprint, to record with the job."""

    tenant: str
    key: str
    fingerprint: str


@dataclass(frozen=True)
class KnownKey:
    """A key seen within its lifetime: the job it made and the fingerprint of that request."""

    job_id: str
    fingerprint: str

    def answer(self, claim: IdempotencyClaim) -> str:
        """Return the job a request with ``claim`` gets; IDEMPOTENCY_KEY_REUSED when it is another request."""
        if claim.fingerprint != self.fingerprint:
            raise IdempotencyKeyReused(
                f"Idempotency-Key {claim.key!r} was used for another request (job {self.job_id})",
                job_id=self.job_id,
            )
        return self.job_id


class KeyTaken(Exception):
    """Raised inside the recording transaction when another request claimed the key first (rolls it back)."""

    def __init__(self, known: KnownKey) -> None:
        super().__init__(f"idempotency key taken by job {known.job_id}")
        self.known = known


def _find(s: Session, tenant: str, key: str, now: datetime) -> KnownKey | None:
    row = s.execute(
        select(IdempotencyKey.job_id, IdempotencyKey.fingerprint).where(
            IdempotencyKey.tenant == tenant, IdempotencyKey.key == key, IdempotencyKey.created_at > now - KEY_LIFETIME
        )
    ).one_or_none()
    return KnownKey(row.job_id, row.fingerprint) if row else None


def claim_key(s: Session, claim: IdempotencyClaim, job_id: str, now: datetime) -> None:
    """Record ``claim`` for ``job_id`` in the job's transaction; KeyTaken when another job holds the key.

    ``INSERT ... ON CONFLICT DO NOTHING`` then a read, as model names are claimed: of two
    transactions inserting one key, the second waits for the first and then reads its row.
    An expired row of the key is replaced.
    """
    s.execute(
        delete(IdempotencyKey).where(
            IdempotencyKey.tenant == claim.tenant,
            IdempotencyKey.key == claim.key,
            IdempotencyKey.created_at <= now - KEY_LIFETIME,
        )
    )
    insert = pg_insert if s.get_bind().dialect.name == "postgresql" else sqlite_insert
    s.execute(
        insert(IdempotencyKey)
        .values(tenant=claim.tenant, key=claim.key, fingerprint=claim.fingerprint, job_id=job_id, created_at=now)
        .on_conflict_do_nothing(index_elements=["tenant", "key"])
    )
    known = _find(s, claim.tenant, claim.key, now)
    if known is not None and known.job_id != job_id:
        raise KeyTaken(known)


class IdempotencyKeys:
    """Idempotency keys on one database."""

    def __init__(self, db: JobDatabase | str) -> None:
        self.db = job_database(db)

    def find(self, tenant: str, key: str) -> KnownKey | None:
        """Return what ``key`` of ``tenant`` names, while it lives; None for a new (or expired) key."""
        with self.db.read() as s:
            return _find(s, tenant, key, utcnow())

    def purge_expired(self) -> int:
        """Remove the keys past their lifetime; return how many."""
        with self.db.write() as s:
            result = s.execute(delete(IdempotencyKey).where(IdempotencyKey.created_at <= utcnow() - KEY_LIFETIME))
            return int(result.rowcount)  # type: ignore[attr-defined]
