"""API tokens: each has a name, scopes and the tenant it acts for; only its SHA-256 is stored.

Tokens are 256 random bits, so a plain hash is enough (no slow password hash): nobody can
guess a preimage, and a lookup by hash is one indexed read.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Sequence

from sqlalchemy import select, update

from services.errors import InvalidSpec, KilnError
from services.jobs.database import JobDatabase, job_database
from services.jobs.models import DEFAULT_TENANT, ApiToken, utcnow

__all__ = ["SCOPES", "TENANT_PATTERN", "TokenStore", "check_tenant", "hash_token"]

#: Scopes a token may carry; "write" implies "read", "admin" implies both and every tenant.
SCOPES = ("read", "write", "admin")
#: A tenant's name: what `kiln token create --tenant` accepts.
TENANT_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"


def hash_token(token: str) -> str:
    """Return the stored form of a bearer token."""
    return hashlib.sha256(token.encode()).hexdigest()


def check_tenant(tenant: str) -> str:
    """Return ``tenant`` when it is a valid tenant name; INVALID_SPEC naming the rule otherwise."""
    if not re.fullmatch(TENANT_PATTERN, tenant):
        raise InvalidSpec(
            f"{tenant!r} is not a tenant name",
            hint="A tenant is 1 to 64 of a-z, 0-9, '_', '.', '-', starting with a letter or digit.",
            field="tenant",
        )
    return tenant


class TokenStore:
    """API tokens on one database."""

    def __init__(self, db: JobDatabase | str) -> None:
        self.db = job_database(db)

    def create_token(
        self,
        name: str,
        scopes: Sequence[str] = ("read", "write"),
        tenant: str = DEFAULT_TENANT,
        *,
        max_running_jobs: int | None = None,
        max_queued_jobs: int | None = None,
    ) -> str:
        """Create a token of ``tenant`` and return it in clear text (the only time it is shown).

        ``max_running_jobs`` and ``max_queued_jobs``: quotas for the jobs this token submits
        (services/jobs/quotas.py); None takes the settings'.
        """
        token = f"kiln_{secrets.token_hex(4)}_{secrets.token_urlsafe(32)}"
        self.add_token(name, token, scopes, tenant, max_running_jobs=max_running_jobs, max_queued_jobs=max_queued_jobs)
        return token

    def add_token(
        self,
        name: str,
        token: str,
        scopes: Sequence[str],
        tenant: str = DEFAULT_TENANT,
        *,
        max_running_jobs: int | None = None,
        max_queued_jobs: int | None = None,
    ) -> None:
        """Record ``token`` (made elsewhere, e.g. a generated admin token) under ``name``."""
        bad = [sc for sc in scopes if sc not in SCOPES]
        if bad:
            raise KilnError(f"unknown scope(s) {bad}", hint=f"Scopes: {', '.join(SCOPES)}.")
        for what, limit in (("max_running_jobs", max_running_jobs), ("max_queued_jobs", max_queued_jobs)):
            if limit is not None and limit < 1:
                raise InvalidSpec(f"{what} must be at least 1, not {limit}", hint="Leave it out to use the setting.")
        check_tenant(tenant)
        token_id = token.split("_")[1] if token.startswith("kiln_") and token.count("_") >= 2 else secrets.token_hex(4)
        with self.db.write() as s:
            if s.scalar(select(ApiToken.id).where(ApiToken.name == name)) is not None:
                raise KilnError(f"a token named {name!r} exists", hint="Revoke it first or pick another name.")
            if s.get(ApiToken, token_id) is not None:
                token_id = secrets.token_hex(8)
            s.add(
                ApiToken(
                    id=token_id,
                    name=name,
                    token_sha256=hash_token(token),
                    scopes=" ".join(scopes),
                    tenant=tenant,
                    max_running_jobs=max_running_jobs,
                    max_queued_jobs=max_queued_jobs,
                )
            )

    def ensure_token(self, name: str, token: str, scopes: Sequence[str], tenant: str = DEFAULT_TENANT) -> bool:
        """Make ``token`` a live token named ``name`` (the deployment's admin token); return whether it changed.

        Idempotent at every start; a changed token (rotated in its Secret) revokes and renames
        the old record, so the old value stops working.
        """
        digest = hash_token(token)
        with self.db.read() as s:
            current = s.scalars(select(ApiToken).where(ApiToken.token_sha256 == digest)).one_or_none()
        if current is not None and current.revoked_at is None and current.name == name:
            return False
        with self.db.write() as s:
            old = s.scalars(select(ApiToken).where(ApiToken.name == name)).one_or_none()
            if old is not None:
                old.revoked_at = old.revoked_at or utcnow()
                old.name = f"{name}-replaced-{old.id}"
            if current is not None and current.name != name:
                s.delete(current)  # the same secret under another name: one record per secret
        self.add_token(name, token, scopes, tenant)
        return True

    def verify_token(self, token: str) -> ApiToken | None:
        """Return the live token record matching ``token``, or None."""
        with self.db.read() as s:
            rec = s.scalars(select(ApiToken).where(ApiToken.token_sha256 == hash_token(token))).one_or_none()
        if rec is None or rec.revoked_at is not None:
            return None
        return rec

    def revoke_token(self, name: str) -> bool:
        with self.db.write() as s:
            res = s.execute(
                update(ApiToken).where(ApiToken.name == name, ApiToken.revoked_at.is_(None)).values(revoked_at=utcnow())
            )
            return res.rowcount == 1  # type: ignore[attr-defined]

    def list_tokens(self) -> list[ApiToken]:
        with self.db.read() as s:
            return list(s.scalars(select(ApiToken).order_by(ApiToken.created_at)).all())
