"""HTTP with retries: what is safe to send again is sent again, with backoff, and nothing else is.

Retried:

- any request that never reached the server (the connection could not be made);
- idempotent requests (GET, DELETE, POST /plan, and submits carrying an ``Idempotency-Key``)
  after a connection that broke or timed out, and after 502, 503 or 504 — but not after a 503
  ``ENGINE_UNAVAILABLE``, which says how the service is deployed, not that it is busy.

The backoff doubles from ``backoff`` seconds up to ``max_backoff``, with jitter, and follows
the server's ``Retry-After`` when it sends one (up to ``max_backoff``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from kiln_client._errors import KilnError

__all__ = ["Http", "RetryPolicy"]

#: Statuses that mean "a proxy or the service is briefly unable", worth another try.
TRANSIENT_STATUSES = (502, 503, 504)
#: 503 codes that are an answer, not a hiccup: retrying would only delay the same answer.
FINAL_503_CODES = ("ENGINE_UNAVAILABLE",)


class RetryPolicy:
    """How often and how patiently to retry."""

    def __init__(self, retries: int = 5, backoff: float = 0.5, max_backoff: float = 10.0) -> None:
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff

    def delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        """Return the seconds to wait before retry number ``attempt`` (0-based)."""
        if response is not None:
            after = response.headers.get("retry-after", "")
            if after.strip().isdigit():
                return min(float(after), self.max_backoff)
        base: float = min(self.backoff * 2.0**attempt, self.max_backoff)
        return base * (0.5 + random.random() / 2)


def _transient(response: httpx.Response) -> bool:
    if response.status_code not in TRANSIENT_STATUSES:
        return False
    try:
        code = response.json().get("code")
    except Exception:
        return True  # a proxy's page: the service behind it may be back soon
    return code not in FINAL_503_CODES


class Http:
    """An ``httpx.Client`` on the service's base URL, with the token, errors as :class:`KilnError`, and retries."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout: float,
        policy: RetryPolicy,
        transport: httpx.BaseTransport | None = None,
        verify: Any = True,
        user_agent: str = "kiln-client",
    ) -> None:
        self.base_url = url.rstrip("/")
        headers = {"User-Agent": user_agent, "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.policy = policy
        self.client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            transport=transport,
            verify=verify,
        )

    def close(self) -> None:
        self.client.close()

    def _unreachable(self, exc: Exception, method: str, path: str) -> KilnError:
        return KilnError(
            "SERVICE_UNAVAILABLE",
            f"{method} {self.base_url}{path} failed: {type(exc).__name__}: {exc}",
            "Check that the Kiln server is running and reachable at this URL (GET /readyz).",
        )

    def request(
        self,
        method: str,
        path: str,
        *,
        idempotent: bool,
        build: Callable[[], dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send a request and return its 2xx/3xx answer; raise :class:`KilnError` for an error answer.

        ``build`` returns more keyword arguments per attempt (an upload opens its files again
        for each try, so a retry sends the whole body from the start).
        """
        attempt = 0
        while True:
            try:
                if build is None:
                    response = self.client.request(method, path, **kwargs)
                else:
                    with _built(build) as extra:
                        response = self.client.request(method, path, **kwargs, **extra)
            except httpx.TransportError as exc:
                # A request that never connected was never seen: safe to send again, whatever it is.
                never_sent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
                if attempt >= self.policy.retries or not (idempotent or never_sent):
                    raise self._unreachable(exc, method, path) from None
                time.sleep(self.policy.delay(attempt))
                attempt += 1
                continue
            if idempotent and attempt < self.policy.retries and _transient(response):
                time.sleep(self.policy.delay(attempt, response))
                attempt += 1
                continue
            if response.status_code >= 400:
                raise KilnError.from_response(response)
            return response

    @contextmanager
    def stream(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        """Open a streamed answer (events, downloads); an error answer is read and raised as :class:`KilnError`."""
        with self.client.stream(method, path, **kwargs) as response:
            if response.status_code >= 400:
                response.read()
                raise KilnError.from_response(response)
            yield response


@contextmanager
def _built(build: Callable[[], dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Call ``build`` and close the files it opened when the attempt is over."""
    extra = build()
    try:
        yield extra
    finally:
        for part in (extra.get("files") or {}).values():
            close = getattr(part[1], "close", None) if isinstance(part, tuple) and len(part) > 1 else None
            if callable(close):
                close()
