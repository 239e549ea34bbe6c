"""The client's one exception: the API's error body (code, message, hint, details) and the HTTP status."""

from __future__ import annotations

import json
from typing import Any

import httpx

__all__ = ["KilnError"]


class KilnError(Exception):
    """An error the service answered, or one the client met on its way (same shape either way).

    ``code`` is the API's stable error code (``INVALID_SPEC``, ``NOT_FOUND``, ``PARITY_FAILED``,
    ...). Errors the client raises itself use the API's codes too: ``SERVICE_UNAVAILABLE`` when
    the server cannot be reached after the retries, ``TIMEOUT`` when :meth:`Job.wait` runs out
    of time. ``status`` is the HTTP status, None when no answer came.
    """

    def __init__(
        self,
        code: str,
        message: str,
        hint: str = "",
        details: dict[str, Any] | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.hint = hint
        self.details: dict[str, Any] = details or {}
        self.status = status

    @classmethod
    def from_body(cls, body: dict[str, Any], status: int | None = None) -> KilnError:
        """Return the error a JSON error body (the API's ``ErrorPublic``) describes."""
        return cls(
            str(body.get("code") or "INTERNAL"),
            str(body.get("message") or ""),
            str(body.get("hint") or ""),
            body.get("details") if isinstance(body.get("details"), dict) else None,
            status,
        )

    @classmethod
    def from_response(cls, response: httpx.Response) -> KilnError:
        """Return the error an HTTP answer carries; a body that is not Kiln's JSON (a proxy's page) is kept short."""
        try:
            body = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            body = None
        if isinstance(body, dict) and "code" in body:
            return cls.from_body(body, response.status_code)
        text = response.text.strip().replace("\n", " ")[:200] if response.content else ""
        code = "SERVICE_UNAVAILABLE" if response.status_code in (502, 503, 504) else "INTERNAL"
        return cls(
            code,
            f"HTTP {response.status_code} from {response.request.url}" + (f": {text}" if text else ""),
            "The answer did not come from Kiln's API (a proxy or another server?); check the URL.",
            status=response.status_code,
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the error as the API's JSON error body."""
        body: dict[str, Any] = {"code": self.code, "message": self.message, "hint": self.hint}
        if self.details:
            body["details"] = self.details
        return body
