"""Dashboard sessions: a random id the browser holds (signed, in a cookie), mapped here to its token.

The API token never reaches the browser after sign-in: the cookie carries the session id,
signed by the API (api.ui.cookies), and only its SHA-256 is stored. A session lives until
it expires, its user signs out, or its token is revoked (it is read joined to a live token).
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from sqlalchemy import delete, select

from services.jobs.database import JobDatabase, job_database
from services.jobs.models import ApiToken, DashboardSession, utcnow

__all__ = ["SessionStore"]


def _digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class SessionStore:
    """Dashboard sessions on one database."""

    def __init__(self, db: JobDatabase | str) -> None:
        self.db = job_database(db)

    def open_session(self, token_id: str, lifetime: float) -> str:
        """Start a session for the token ``token_id`` lasting ``lifetime`` seconds; return its id (shown once)."""
        session_id = secrets.token_urlsafe(32)
        now = utcnow()
        with self.db.write() as s:
            s.execute(delete(DashboardSession).where(DashboardSession.expires_at < now))  # expired ones go
            s.add(
                DashboardSession(
                    id_sha256=_digest(session_id),
                    token_id=token_id,
                    created_at=now,
                    expires_at=now + timedelta(seconds=lifetime),
                )
            )
        return session_id

    def session_token(self, session_id: str) -> ApiToken | None:
        """Return the live token behind a live session, or None."""
        with self.db.read() as s:
            return s.scalars(
                select(ApiToken)
                .join(DashboardSession, DashboardSession.token_id == ApiToken.id)
                .where(
                    DashboardSession.id_sha256 == _digest(session_id),
                    DashboardSession.expires_at > utcnow(),
                    ApiToken.revoked_at.is_(None),
                )
            ).one_or_none()

    def close_session(self, session_id: str) -> None:
        """End a session (signing out)."""
        with self.db.write() as s:
            s.execute(delete(DashboardSession).where(DashboardSession.id_sha256 == _digest(session_id)))
