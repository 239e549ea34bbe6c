"""Cut the configured secret values out of everything a step prints, whatever path it took.

Defence in depth behind the scrubbed environment: a secret a step could still learn (a
library that read it before the sandbox, a bug) never reaches a log line, an error, an
event or a manifest as itself. The secrets are the settings that are secrets (the S3 secret
key, passwords inside the database and broker URLs, the S3 access key id) and environment
variables whose names say they hold one (``*SECRET*``, ``*PASSWORD*``, ``*TOKEN*``,
``*_KEY``, ``AWS_*``); values shorter than 6 characters are left alone (they would match
ordinary text).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["Redactor"]

_SECRET_NAME = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|_KEY$|^AWS_|PRIVATE", re.IGNORECASE)
_MIN_LEN = 6
MASK = "[redacted]"


def _url_password(url: str) -> str | None:
    try:
        pw = urlsplit(url).password
    except ValueError:
        return None
    return unquote(pw) if pw else None


class Redactor:
    """Replaces each known secret value (and its URL-quoted form) with ``[redacted]``."""

    def __init__(self, secrets: Iterable[str]) -> None:
        values = {s for s in secrets if s and len(s) >= _MIN_LEN}
        values |= {v.replace("/", "%2F").replace("+", "%2B") for v in values}
        self.secrets = tuple(sorted(values, key=len, reverse=True))
        self._pattern = re.compile("|".join(re.escape(s) for s in self.secrets)) if self.secrets else None

    @classmethod
    def from_settings(cls, settings: Any, environ: Mapping[str, str]) -> Redactor:
        """Return the redactor for a process configured by ``settings`` and ``environ``."""
        secrets = [settings.s3_secret_access_key.get_secret_value(), settings.s3_access_key_id]
        secrets += [p for p in (_url_password(settings.database_url), _url_password(settings.broker_url)) if p]
        secrets += [v for k, v in environ.items() if _SECRET_NAME.search(k)]
        secrets += [p for v in environ.values() if "://" in v and (p := _url_password(v))]
        # The signing key's PEM, line by line: a leak of part of it is cut as well as the whole.
        signing = getattr(settings, "signing_key", None)
        pem = signing.get_secret_value() if signing is not None else ""
        secrets += [line.strip() for line in pem.splitlines() if line.strip() and not line.startswith("-----")]
        return cls(secrets)

    def text(self, value: str) -> str:
        """Return ``value`` with every secret replaced."""
        if self._pattern is None or not value:
            return value
        return self._pattern.sub(MASK, value)

    def data(self, value: Any) -> Any:
        """Return a JSON-like structure with every string in it (keys too) redacted."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(str(k)): self.data(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.data(v) for v in value]
        return value

    def json_text(self, value: Any) -> Any:
        """Return ``value`` redacted after a JSON round trip (values of other types become their str)."""
        return self.data(json.loads(json.dumps(value, default=str)))
