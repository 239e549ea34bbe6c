"""The dashboard's session cookie and CSRF tokens: what the browser holds instead of the API token.

The cookie ``kiln_session`` (HttpOnly, SameSite=Strict, Secure when the request came over
https, directly or as a trusted proxy says) carries a random session id signed with the
deployment's session key (itsdangerous, as Flask and Starlette sign theirs): a forged or
altered cookie is refused before any lookup, and a stolen cookie is not an API token.

What a session may do, exactly:

- GET and HEAD with the cookie alone (pages, event streams, downloads);
- any other method of the API (``/compile``, ``/jobs/...``, ``/plan``) only with the
  session's CSRF token in the ``X-CSRF-Token`` header;
- the dashboard's own form posts (``/ui/...``) with that token in the header or in the
  ``csrf_token`` form field.

The CSRF token is an HMAC of the session id under the same key: a cross-site page can make
the browser send the cookie but can read neither it nor the page that carries the token.
Bearer requests need no CSRF token: nothing ambient a cross-site page could use.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

from itsdangerous import BadSignature, Signer

from services.errors import Forbidden, Unauthorized
from services.settings import Settings

__all__ = [
    "CSRF_FIELD",
    "CSRF_HEADER",
    "SAFE_METHODS",
    "SESSION_COOKIE",
    "SessionKeys",
    "request_session",
    "require_csrf",
    "session_keys",
    "set_session_cookie",
]

SESSION_COOKIE = "kiln_session"
CSRF_HEADER = "X-CSRF-Token"
CSRF_FIELD = "csrf_token"
SAFE_METHODS = ("GET", "HEAD")


class SessionKeys:
    """Signs session ids for the cookie and derives each session's CSRF token, under one key."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._signer = Signer(secret, salt="kiln-dashboard-session")

    def sign(self, session_id: str) -> str:
        return self._signer.sign(session_id.encode()).decode()

    def unsign(self, cookie: str) -> str | None:
        """Return the session id of a cookie this key signed, or None (forged, altered, another key's)."""
        try:
            return self._signer.unsign(cookie.encode()).decode()
        except (BadSignature, UnicodeError):
            return None

    def csrf_token(self, session_id: str) -> str:
        return hmac.new(self._secret, b"kiln-csrf:" + session_id.encode(), hashlib.sha256).hexdigest()

    def csrf_matches(self, session_id: str, sent: str) -> bool:
        # Bytes: compare_digest raises on a non-ASCII str, which a client controls.
        return hmac.compare_digest(sent.encode(), self.csrf_token(session_id).encode())


def _key_file(settings: Settings) -> bytes:
    """Return the development key kept in the data dir, made on first use (0600)."""
    path = Path(settings.data_dir) / "session-secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    return path.read_bytes().strip()


def session_keys(settings: Settings) -> SessionKeys:
    """Return the session keys of ``settings``: KILN_SESSION_SECRET, else the data dir's own key.

    With auth off there are no sessions: a key of this process alone, nothing written.
    """
    secret = settings.session_secret.get_secret_value().encode()
    if not secret and not settings.auth_enabled:
        return SessionKeys(secrets.token_bytes(32))
    return SessionKeys(secret or _key_file(settings))


def request_session(request: Any) -> str | None:
    """Return the session id the request's cookie carries; UNAUTHORIZED for a cookie this server did not sign."""
    cookie = request.cookies.get(SESSION_COOKIE)
    if not cookie:
        return None
    session_id: str | None = request.app.state.session_keys.unsign(cookie)
    if session_id is None:
        raise Unauthorized("the session cookie is not one this server signed", hint="Sign in again at /ui/login.")
    return session_id


def require_csrf(request: Any, session_id: str, form_value: str | None = None) -> None:
    """Refuse a state-changing request of a session without its CSRF token (header, or ``form_value``)."""
    keys: SessionKeys = request.app.state.session_keys
    sent = request.headers.get(CSRF_HEADER) or form_value or ""
    if not keys.csrf_matches(session_id, sent):
        where = f"the {CSRF_HEADER} header" + (f" or the {CSRF_FIELD} field" if form_value is not None else "")
        raise Forbidden(
            "a dashboard session may change things only with its CSRF token",
            hint=f"Send {where} the dashboard's pages carry, or use an Authorization header.",
        )


def set_session_cookie(response: Any, request: Any, value: str, max_age: float) -> None:
    """Set the signed session cookie: Secure whenever the request came over https (trusted proxies included)."""
    response.set_cookie(
        SESSION_COOKIE,
        value,
        max_age=int(max_age),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
