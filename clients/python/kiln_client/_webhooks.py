"""Checking a Kiln webhook on the receiving side: the signature and the timestamp."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping

__all__ = ["verify_webhook"]


def verify_webhook(secret: str, headers: Mapping[str, str], body: bytes, *, tolerance: float = 300.0) -> bool:
    """Return True when a webhook POST is Kiln's: its ``X-Kiln-Signature`` matches and it is recent.

    ``headers``: the request's headers (any case); ``body``: its raw bytes, before any JSON
    parsing. The signature is ``sha256=`` + the hex HMAC-SHA256, keyed by ``secret`` (the
    spec's ``notify.secret``), of ``<X-Kiln-Timestamp>.<body>``; a timestamp more than
    ``tolerance`` seconds from now is refused, so a captured POST cannot be replayed later.
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    timestamp, signature = lowered.get("x-kiln-timestamp", ""), lowered.get("x-kiln-signature", "")
    if not timestamp.isdigit() or abs(time.time() - int(timestamp)) > tolerance:
        return False
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return hmac.compare_digest("sha256=" + mac.hexdigest(), signature)
