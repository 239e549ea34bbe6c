"""Webhook deliveries in the job store: recorded with the job, made due by its end, claimed, sent, recorded.

The row is written in the transaction that records the job (with the secret, which the
job's spec never holds) and marked due in the transaction that ends the job, so a job that
ends is never forgotten, whatever process dies. A sender claims a due row with a lease (a
guarded UPDATE: two API processes never send one attempt twice), posts outside any
transaction, and records the outcome as the job's event: ``webhook_delivered``,
``webhook_failed`` (with the retry time) or ``webhook_gave_up``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from services.jobs.database import JobDatabase, job_database
from services.jobs.models import Job, JobEventType, Webhook, utcnow

__all__ = ["ClaimedWebhook", "NewWebhook", "WebhookStore", "mark_due", "record_webhook", "url_origin"]

#: How long a claimed delivery is its sender's: one POST with its timeout fits well inside.
LEASE = timedelta(seconds=60)


@dataclass(frozen=True)
class NewWebhook:
    """The spec's notify, with the secret that signs it."""

    url: str
    events: list[str]
    secret: str


@dataclass(frozen=True)
class ClaimedWebhook:
    """A delivery a sender holds: where, what to sign with, which attempt, and the job as it ended."""

    job_id: str
    url: str
    secret: str
    event: str
    attempt: int
    job: Job


def url_origin(url: str) -> str:
    """Return ``scheme://host[:port]`` of ``url``: what events show (a path or query may carry a token)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}"


def record_webhook(s: Session, job_id: str, hook: NewWebhook) -> None:
    """Record ``job_id``'s webhook, waiting for the job to end (in the job's own transaction)."""
    s.add(Webhook(job_id=job_id, url=hook.url, events=list(hook.events), secret=hook.secret, state="waiting"))


def mark_due(s: Session, job_id: str, status: str, now: datetime) -> None:
    """Make the job's webhook due now that it ended ``status``, if it asked for that (in the ending transaction)."""
    hook = s.get(Webhook, job_id)
    if hook is None or hook.state != "waiting":
        return
    wanted = "finished" in hook.events or status in hook.events
    hook.state, hook.event, hook.next_at = ("due" if wanted else "not_sent"), status, now


class WebhookStore:
    """Webhook deliveries on one database."""

    def __init__(self, db: JobDatabase | str) -> None:
        self.db = job_database(db)

    def secret_for(self, job_id: str, url: str) -> str | None:
        """Return the secret of ``job_id``'s webhook when it posts to ``url`` (a resubmission keeps it)."""
        with self.db.read() as s:
            hook = s.get(Webhook, job_id)
            return hook.secret if hook is not None and hook.url == url else None

    def state(self, job_id: str) -> dict[str, Any] | None:
        """Return the delivery's state (no secret): state, event, attempts, last_error; None without a webhook."""
        with self.db.read() as s:
            hook = s.get(Webhook, job_id)
            if hook is None:
                return None
            return {"state": hook.state, "event": hook.event, "attempts": hook.attempts, "last_error": hook.last_error}

    def due(self, limit: int = 20) -> list[str]:
        """Return the jobs whose webhook is due now and not held by a sender."""
        now = utcnow()
        with self.db.read() as s:
            return list(
                s.scalars(
                    select(Webhook.job_id)
                    .where(
                        Webhook.state == "due",
                        Webhook.next_at <= now,
                        or_(Webhook.claimed_until.is_(None), Webhook.claimed_until < now),
                    )
                    .order_by(Webhook.next_at)
                    .limit(limit)
                ).all()
            )

    def claim(self, job_id: str) -> ClaimedWebhook | None:
        """Take the due delivery of ``job_id`` for one attempt; None when another sender has it or it is not due."""
        now = utcnow()
        with self.db.write() as s:
            taken = s.execute(
                update(Webhook)
                .where(
                    Webhook.job_id == job_id,
                    Webhook.state == "due",
                    Webhook.next_at <= now,
                    or_(Webhook.claimed_until.is_(None), Webhook.claimed_until < now),
                )
                .values(claimed_until=now + LEASE, attempts=Webhook.attempts + 1)
            )
            if taken.rowcount != 1:  # type: ignore[attr-defined]
                return None
            hook = s.get(Webhook, job_id)
            job = s.get(Job, job_id)
            assert hook is not None and job is not None
            return ClaimedWebhook(job_id, hook.url, hook.secret, hook.event or "", hook.attempts, job)

    def delivered(self, claim: ClaimedWebhook, status: int) -> None:
        """Record a 2xx answer: delivered, with the job's ``webhook_delivered`` event."""
        with self.db.write() as s:
            self.db.lock_job_row(s, claim.job_id)
            s.execute(
                update(Webhook)
                .where(Webhook.job_id == claim.job_id)
                .values(state="delivered", claimed_until=None, last_error=None)
            )
            self.db.add_event(
                s,
                claim.job_id,
                "webhook_delivered",
                url=url_origin(claim.url),
                event=claim.event,
                status=status,
                attempt=claim.attempt,
            )

    def failed(self, claim: ClaimedWebhook, error: str, retry_in: float | None) -> None:
        """Record a failed attempt: due again in ``retry_in`` seconds, or given up (None)."""
        now = utcnow()
        with self.db.write() as s:
            self.db.lock_job_row(s, claim.job_id)
            values: dict[str, Any] = {"claimed_until": None, "last_error": error[:1000]}
            if retry_in is None:
                values["state"] = "gave_up"
            else:
                values["next_at"] = now + timedelta(seconds=retry_in)
            s.execute(update(Webhook).where(Webhook.job_id == claim.job_id).values(**values))
            kind: JobEventType = "webhook_gave_up" if retry_in is None else "webhook_failed"
            data: dict[str, Any] = {"url": url_origin(claim.url), "event": claim.event, "attempt": claim.attempt}
            data["message"] = error[:300]
            if retry_in is not None:
                data["retry_in"] = round(retry_in, 3)
            self.db.add_event(s, claim.job_id, kind, **data)
