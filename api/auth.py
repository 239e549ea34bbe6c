"""Bearer API tokens: 401 without a valid token, 403 with a valid one lacking the scope.

Tokens are stored hashed (services.jobs.store). Verified tokens are remembered for a few
seconds so a busy poller does not cost a database lookup per request; a revoked token
therefore stops working within ``CACHE_SECONDS``.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from services.errors import Forbidden, Unauthorized
from services.jobs.store import hash_token

__all__ = ["CACHE_SECONDS", "CSRF_HEADER", "SESSION_COOKIE", "Principal", "authenticate", "csrf_token", "session_token"]

CACHE_SECONDS = 5.0
#: The dashboard's session: the API token itself, in an HttpOnly, SameSite=Strict cookie.
SESSION_COOKIE = "kiln_session"
#: Requests other than GET/HEAD that authenticate with the session cookie must carry this header.
CSRF_HEADER = "X-CSRF-Token"
_SAFE_METHODS = ("GET", "HEAD")
_IMPLIED = {"admin": {"admin", "write", "read"}, "write": {"write", "read"}, "read": {"read"}}


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's name and scopes, or anonymous when auth is off."""

    name: str | None
    scopes: frozenset[str]

    def allows(self, scope: str) -> bool:
        return scope in self.scopes


ANONYMOUS = Principal(name=None, scopes=frozenset(_IMPLIED["admin"]))


class TokenCache:
    """Recently verified tokens (by hash) with their principal."""

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


async def authenticate(state: Any, token: str | None, scope: str) -> Principal:
    """Return the caller for ``token`` if it may use ``scope``; raise UNAUTHORIZED or FORBIDDEN."""
    if not state.settings.auth_enabled:
        return ANONYMOUS
    if not token:
        raise Unauthorized("this endpoint needs an API token")
    cache: TokenCache = state.token_cache
    digest = hash_token(token)
    principal = cache.get(digest)
    if principal is None:
        rec = await run_in_threadpool(state.jobs.verify_token, token)
        if rec is None:
            raise Unauthorized("the API token is unknown or revoked")
        scopes: set[str] = set()
        for s in rec.scopes.split():
            scopes |= _IMPLIED.get(s, {s})
        principal = Principal(name=rec.name, scopes=frozenset(scopes))
        cache.put(digest, principal)
    if not principal.allows(scope):
        raise Forbidden(
            f"token {principal.name!r} lacks the {scope!r} scope this call needs",
            hint=f"Create a token with --scope {scope}.",
        )
    return principal


def csrf_token(session: str) -> str:
    """Return the CSRF token of a session: an HMAC keyed by its (secret) API token.

    A cross-site page can make the browser send the cookie but cannot read it, so it cannot
    compute this value; the dashboard puts it in its pages for its own form posts.
    """
    return hmac.new(session.encode(), b"kiln-csrf", hashlib.sha256).hexdigest()


def session_token(request: Any) -> str | None:
    """Return the API token of the request's dashboard session cookie, if it may be used here.

    The cookie stands in for the bearer token on GET and HEAD (pages, SSE, downloads); on any
    other method only with the session's CSRF token in the ``X-CSRF-Token`` header or the
    ``csrf_token`` form field the dashboard sends.
    """
    session = request.cookies.get(SESSION_COOKIE)
    if not session:
        return None
    if request.method in _SAFE_METHODS:
        return str(session)
    sent = request.headers.get(CSRF_HEADER, "")
    if not hmac.compare_digest(sent.encode(), csrf_token(session).encode()):  # bytes: a non-ASCII str would raise
        raise Forbidden(
            "a dashboard session may change things only with its CSRF token",
            hint=f"Send the {CSRF_HEADER} header the dashboard's pages carry, or use an Authorization header.",
        )
    return str(session)
