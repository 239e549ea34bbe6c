"""Who is calling: bearer API tokens and dashboard sessions; 401 without either, 403 without the scope.

A caller is a :class:`Principal`: a token's name, scopes and tenant. Tokens are stored
hashed (services.jobs.tokens); the dashboard's cookie holds a signed session id, never the
token (api.sessions). Verified tokens and sessions are remembered for a few seconds so a
busy poller does not cost a database lookup per request; a revoked token therefore stops
working within ``CACHE_SECONDS`` (signing out ends a session at once in this process).
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from services.errors import Forbidden, Unauthorized
from services.jobs.models import DEFAULT_TENANT, ApiToken
from services.jobs.tokens import hash_token

__all__ = [
    "ANONYMOUS",
    "CACHE_SECONDS",
    "Principal",
    "TokenCache",
    "authenticate",
    "authenticate_session",
    "forget_session",
]

CACHE_SECONDS = 5.0
_IMPLIED = {"admin": {"admin", "write", "read"}, "write": {"write", "read"}, "read": {"read"}}


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's name, scopes and tenant, or the anonymous admin when auth is off."""

    name: str | None
    scopes: frozenset[str]
    tenant: str = DEFAULT_TENANT
    #: The token's own quotas (services/jobs/quotas.py); None: the settings'.
    max_running_jobs: int | None = None
    max_queued_jobs: int | None = None

    def allows(self, scope: str) -> bool:
        return scope in self.scopes

    @property
    def sees_all(self) -> bool:
        """Whether this caller reads and changes every tenant's jobs (admin scope)."""
        return "admin" in self.scopes

    @property
    def tenant_filter(self) -> str | None:
        """The tenant whose jobs this caller sees, or None for every tenant's."""
        return None if self.sees_all else self.tenant


#: The caller when auth is off (`kiln serve` on a laptop's loopback): admin, in the default tenant.
ANONYMOUS = Principal(name=None, scopes=frozenset(_IMPLIED["admin"]))


def principal_of(rec: ApiToken) -> Principal:
    """Return the principal a token record stands for."""
    scopes: set[str] = set()
    for s in rec.scopes.split():
        scopes |= _IMPLIED.get(s, {s})
    return Principal(
        name=rec.name,
        scopes=frozenset(scopes),
        tenant=rec.tenant,
        max_running_jobs=rec.max_running_jobs,
        max_queued_jobs=rec.max_queued_jobs,
    )


class TokenCache:
    """Recently verified tokens and sessions (by hash) with their principal."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[float, Principal]] = {}
        self._lock = threading.Lock()

    def get(self, digest: str) -> Principal | None:
        with self._lock:
            item = self._items.get(digest)
        if item and item[0] > time.monotonic():
            return item[1]
        return None

    def put(self, digest: str, principal: Principal) -> None:
        with self._lock:
            if len(self._items) > 10_000:
                self._items.clear()
            self._items[digest] = (time.monotonic() + CACHE_SECONDS, principal)

    def drop(self, digest: str) -> None:
        with self._lock:
            self._items.pop(digest, None)


def _require_scope(principal: Principal, scope: str) -> Principal:
    if not principal.allows(scope):
        raise Forbidden(
            f"token {principal.name!r} lacks the {scope!r} scope this call needs",
            hint=f"Create a token with --scope {scope}.",
        )
    return principal


async def authenticate(state: Any, token: str | None, scope: str) -> Principal:
    """Return the caller for bearer ``token`` if it may use ``scope``; raise UNAUTHORIZED or FORBIDDEN."""
    if not state.settings.auth_enabled:
        return ANONYMOUS
    if not token:
        raise Unauthorized("this endpoint needs an API token")
    cache: TokenCache = state.token_cache
    digest = hash_token(token)
    principal = cache.get(digest)
    if principal is None:
        rec = await run_in_threadpool(state.tokens.verify_token, token)
        if rec is None:
            raise Unauthorized("the API token is unknown or revoked")
        principal = principal_of(rec)
        cache.put(digest, principal)
    return _require_scope(principal, scope)


def _session_digest(session_id: str) -> str:
    return "session:" + hashlib.sha256(session_id.encode()).hexdigest()


async def authenticate_session(state: Any, session_id: str, scope: str) -> Principal:
    """Return the caller of a dashboard session (its id already unsigned) if it may use ``scope``."""
    cache: TokenCache = state.token_cache
    digest = _session_digest(session_id)
    principal = cache.get(digest)
    if principal is None:
        rec = await run_in_threadpool(state.sessions.session_token, session_id)
        if rec is None:
            raise Unauthorized(
                "the dashboard session has ended (signed out, expired, or its token was revoked)",
                hint="Sign in again at /ui/login.",
            )
        principal = principal_of(rec)
        cache.put(digest, principal)
    return _require_scope(principal, scope)


def forget_session(state: Any, session_id: str) -> None:
    """Drop a session from this process's cache (signing out: it must stop working at once)."""
    state.token_cache.drop(_session_digest(session_id))
