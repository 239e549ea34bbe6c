"""Refuse what a browser sends on behalf of another site: cross-origin state changes, foreign Host names.

With auth off (`kiln serve` on a laptop) every caller is an admin, and a page on any site
the laptop's browser opens could otherwise POST a model to ``127.0.0.1:8000``: the browser
sends a cross-origin form or ``fetch`` without asking. So whether auth is on or off, a
request other than GET/HEAD/OPTIONS is refused with FORBIDDEN when

- ``Sec-Fetch-Site`` says ``cross-site`` (every current browser sends it), or
- it carries an ``Origin`` that is neither the API's own (scheme and Host of the request,
  after trusted proxy headers) nor one of ``KILN_ALLOWED_ORIGINS``; ``Origin: null``
  (sandboxed frames, file: pages) is foreign too. ``https://<Host>`` is always the API's own:
  behind a TLS-terminating proxy the browser's origin is https while the connection here is
  http, and nothing but that host's own https pages carries it. (The reverse, an
  ``http://`` page posting to a request that came over https, is refused.)

Pipelines (curl, httpx, the Python client) send neither header and are not affected.
``KILN_ALLOWED_HOSTS`` additionally limits the Host names answered at all: a DNS-rebinding
page reaches the loopback API under its own host name, which the Origin check would take
for same-origin.
"""

from __future__ import annotations

from typing import Any

from api.errors import error_response
from services.errors import Forbidden

__all__ = ["OriginGuard"]

_UNSAFE_EXEMPT = (b"GET", b"HEAD", b"OPTIONS")


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _host_name(host: str) -> str:
    """Return the name part of a Host header (no port; IPv6 brackets kept)."""
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class OriginGuard:
    """ASGI middleware: FORBIDDEN for cross-site state changes and for Host names not allowed."""

    def __init__(self, app: Any, *, allowed_origins: list[str], allowed_hosts: list[str]) -> None:
        self.app = app
        self.allowed_origins = set(allowed_origins)
        self.allowed_hosts = set(allowed_hosts)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: dict[str, Any]) -> Forbidden | None:
        """Return why the request is refused, or None to let it through."""
        host = (_header(scope, b"host") or "").lower()
        if self.allowed_hosts and host not in self.allowed_hosts and _host_name(host) not in self.allowed_hosts:
            return Forbidden(
                f"this server does not answer for host {host!r}",
                hint="Use the address it was started on (KILN_ALLOWED_HOSTS lists the names it answers).",
            )
        if scope.get("method", "GET").encode() in _UNSAFE_EXEMPT:
            return None
        if (_header(scope, b"sec-fetch-site") or "").strip().lower() == "cross-site":
            return Forbidden(
                "a cross-site request may not change anything here",
                hint="Submit from the dashboard itself or from a pipeline (curl, the Python client).",
            )
        origin = _header(scope, b"origin")
        if origin is None:
            return None
        origin = origin.strip().rstrip("/").lower()
        own = {f"{scope.get('scheme', 'http')}://{host}", f"https://{host}"}
        if origin not in own and origin not in self.allowed_origins:
            return Forbidden(
                f"a request from origin {origin!r} may not change anything here",
                hint="Submit from the dashboard itself or from a pipeline; KILN_ALLOWED_ORIGINS lists other "
                "origins a browser may submit from.",
            )
        return None
