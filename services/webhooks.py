"""Webhooks: where a job may call (outbound checks), what it sends (the job's summary), how it is signed, sending.

A job's ``notify`` makes the service POST the job's public summary to a URL when the job
ends. Each POST carries:

- ``X-Kiln-Timestamp``: Unix seconds when it was signed;
- ``X-Kiln-Signature``: ``sha256=`` and the hex HMAC-SHA256, keyed by the webhook's secret,
  of ``<timestamp>.<body>`` (the timestamp, a dot, the body's bytes), so a receiver can check
  both who sent it and that it is not an old one replayed (refuse timestamps older than
  about 5 minutes);
- ``X-Kiln-Event`` (``succeeded``, ``failed``, ``cancelled``), ``X-Kiln-Job`` and
  ``X-Kiln-Attempt``.

Outbound URLs are checked at submission and again before every attempt: a host that
resolves to a loopback, link-local, private or otherwise non-global address is refused
unless it lies in one of the operator's ``KILN_WEBHOOK_ALLOW_NETWORKS``, so a job cannot
make the service probe its own network. Redirects are not followed (one could lead there).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from services.errors import InvalidSpec
from services.jobs.models import Job
from services.jobs.webhooks import ClaimedWebhook, NewWebhook, WebhookStore, url_origin
from services.spec import CompileSpec

__all__ = [
    "WebhookPolicy",
    "check_url",
    "deliver_due",
    "embedded_ipv4",
    "internal_address",
    "job_summary",
    "new_webhook",
    "sign",
    "stored_spec",
    "verify",
]

log = logging.getLogger("kiln.webhooks")

#: Seconds one POST may take.
POST_TIMEOUT = 10.0
#: The longest wait between two tries.
MAX_RETRY_SECONDS = 600.0


def _refused(url: str, problem: str, hint: str) -> InvalidSpec:
    return InvalidSpec(
        f"notify.url {url_origin(url)}: {problem}", hint=hint, errors=[{"field": "notify.url", "problem": problem}]
    )


#: NAT64's well-known prefix (RFC 6052): the last 32 bits are the IPv4 address a gateway translates to.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
#: The local-use NAT64 prefix (RFC 8215): operator-defined, whatever it embeds is internal.
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
#: IPv4-compatible addresses (deprecated, RFC 4291): ``::a.b.c.d``.
_V4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def embedded_ipv4(addr: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """Return the IPv4 addresses an IPv6 address carries: IPv4-mapped, IPv4-compatible, NAT64, 6to4, Teredo.

    Each of these reaches the IPv4 address inside it (through the host's stack, a NAT64
    gateway, a 6to4 or Teredo relay), so it is judged as that address: ``::7f00:1`` is
    127.0.0.1, ``64:ff9b::a9fe:a9fe`` is 169.254.169.254, ``2002:7f00:1::`` is 127.0.0.1.
    """
    low32 = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    found: list[ipaddress.IPv4Address] = []
    if addr.ipv4_mapped is not None:
        found.append(addr.ipv4_mapped)
    if addr in _V4_COMPATIBLE and int(addr) > 1:  # not :: or ::1, which are their own kind
        found.append(low32)
    if addr in _NAT64:
        found.append(low32)
    if addr.sixtofour is not None:
        found.append(addr.sixtofour)
    if addr.teredo is not None:
        found.extend(addr.teredo)
    return found


def internal_address(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Return whether the service must not call ``addr``: non-global or multicast, itself or any IPv4 inside it."""
    if not addr.is_global or addr.is_multicast:
        return True
    if isinstance(addr, ipaddress.IPv6Address):
        if addr in _NAT64_LOCAL:
            return True
        return any(internal_address(v4) for v4 in embedded_ipv4(addr))
    return False


def check_url(url: str, allow_networks: Iterable[str] = ()) -> None:
    """Refuse (INVALID_SPEC) a webhook URL whose host resolves to an address the service must not call.

    Non-global addresses (loopback, link-local, private, shared, reserved) and multicast are
    refused unless inside one of ``allow_networks`` (CIDRs); an IPv6 address that embeds an
    IPv4 one (:func:`embedded_ipv4`) is refused when that IPv4 address would be.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _refused(url, "not an http(s) URL with a host", "Give an http:// or https:// URL.")
    allowed = [ipaddress.ip_network(n, strict=False) for n in allow_networks]
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        raise _refused(url, f"the host does not resolve ({exc})", "Give a host name the service can resolve.") from None
    for info in infos:
        addr = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if internal_address(addr) and not any(addr in net for net in allowed):
            raise _refused(
                url,
                f"{parts.hostname} is {addr}, a loopback, link-local or private address",
                "Webhooks go to public addresses; an operator may allow internal networks with "
                "KILN_WEBHOOK_ALLOW_NETWORKS (CIDRs).",
            )


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """Return ``X-Kiln-Signature`` for ``body`` signed at ``timestamp``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify(secret: str, timestamp: str, signature: str, body: bytes, *, tolerance: float = 300.0) -> bool:
    """Return whether a webhook's signature is right and its timestamp recent (what a receiver checks)."""
    try:
        ts = int(timestamp)
    except ValueError:
        return False
    if abs(time.time() - ts) > tolerance:
        return False
    return hmac.compare_digest(sign(secret, ts, body), signature)


def job_summary(job: Job) -> dict[str, Any]:
    """Return the job's public summary, the webhook's body: status, source, errors and each target's outcome."""
    targets = {}
    for name, result in (job.result or {}).items():
        parity = result.get("parity") or {}
        targets[name] = {
            "status": result.get("status"),
            "route": result.get("route"),
            "error": result.get("error"),
            "parity_passed": parity.get("passed") if parity else None,
            "published": result.get("published"),
            "download_url": f"/jobs/{job.id}/artifacts/{name}" if result.get("status") == "succeeded" else None,
        }
    return {
        "id": job.id,
        "status": job.status,
        "name": job.name,
        "tenant": job.tenant,
        "url": f"/jobs/{job.id}",
        "created_at": job.created_at.isoformat() if job.created_at else None,
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        "source": {"filename": job.source_filename, "sha256": job.source_sha256, "format": job.source_format},
        "error": job.error,
        "targets": targets,
    }


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a 3xx is the answer, not a hop to follow (it could lead inside the network)


_OPENER = urllib.request.build_opener(_NoRedirect)


def _post(claim: ClaimedWebhook, body: bytes) -> int:
    """POST ``body`` signed; return the HTTP status (raises OSError for a connection that failed)."""
    timestamp = int(time.time())
    request = urllib.request.Request(
        claim.url,
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "User-Agent": "kiln-webhook/0.1",
            "X-Kiln-Event": claim.event,
            "X-Kiln-Job": claim.job_id,
            "X-Kiln-Attempt": str(claim.attempt),
            "X-Kiln-Timestamp": str(timestamp),
            "X-Kiln-Signature": sign(claim.secret, timestamp, body),
        },
    )
    try:
        with _OPENER.open(request, timeout=POST_TIMEOUT) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def deliver_due(store: WebhookStore, settings: Any, limit: int = 20) -> int:
    """Send every due webhook once (each claimed first); return how many were attempted.

    A 2xx answer delivers it; anything else is retried after ``webhook_retry_seconds``,
    doubling, until ``webhook_attempts`` tries were made. Blocking: run it off the event loop.
    """
    attempted = 0
    for job_id in store.due(limit):
        claim = store.claim(job_id)
        if claim is None:
            continue
        attempted += 1
        try:
            check_url(claim.url, settings.webhook_allowed_networks)
            body = json.dumps(job_summary(claim.job), default=str).encode()
            status = _post(claim, body)
            error = None if 200 <= status < 300 else f"HTTP {status}"
        except InvalidSpec as exc:
            status, error = 0, exc.message
        except (OSError, ValueError) as exc:  # refused, timed out, unreachable, a bad URL
            status, error = 0, f"{type(exc).__name__}: {exc}"
        if error is None:
            store.delivered(claim, status)
            continue
        retry: float | None = None
        if claim.attempt < settings.webhook_attempts:
            retry = min(settings.webhook_retry_seconds * 2 ** (claim.attempt - 1), MAX_RETRY_SECONDS)
        log.info("webhook of job %s, attempt %d: %s", job_id, claim.attempt, error)
        store.failed(claim, error, retry)
    return attempted


@dataclass(frozen=True)
class WebhookPolicy:
    """What the operator allows webhooks: internal networks they may reach, the secret for those without one."""

    allow_networks: tuple[str, ...] = ()
    default_secret: str = ""

    @classmethod
    def from_settings(cls, settings: Any) -> WebhookPolicy:
        return cls(tuple(settings.webhook_allowed_networks), settings.webhook_secret.get_secret_value())


def new_webhook(spec: CompileSpec, policy: WebhookPolicy, previous_secret: str | None = None) -> NewWebhook | None:
    """Return the webhook to record for ``spec``'s notify (None without one); INVALID_SPEC when it may not be.

    The secret is the spec's, else ``previous_secret`` (a resubmission of a job that posted to
    the same URL), else the operator's default; without any the job is refused.
    """
    notify = spec.notify
    if notify is None:
        return None
    check_url(notify.url, policy.allow_networks)
    secret = notify.secret.get_secret_value() if notify.secret is not None else previous_secret or policy.default_secret
    if not secret:
        raise InvalidSpec(
            "notify has no secret to sign its webhook with",
            hint="Set notify.secret (at least 16 characters; it is never shown again), or ask the operator for "
            "KILN_WEBHOOK_SECRET.",
            errors=[{"field": "notify.secret", "problem": "missing"}],
        )
    return NewWebhook(url=notify.url, events=[e.value for e in notify.events], secret=secret)


def stored_spec(spec: CompileSpec) -> dict[str, Any]:
    """Return the spec as the job records and shows it: without the webhook's secret."""
    return spec.model_dump(mode="json", exclude={"notify": {"secret"}})
