"""What a job's error may show its users: code, message, hint and a short sanitised excerpt.

A failing step's tool output and Python traceback are for operators: they stay in the step's
log (``GET /jobs/{id}/logs``). The error recorded in the job — served by ``GET /jobs``,
``GET /jobs/{id}`` and the SSE events — carries the code, the message, the hint and the last
few lines of that output that are not traceback frames, with host paths cut to their last
component. The job store applies :func:`public_error` to every error it records, so no route
or writer can forget it.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["EXCERPT_CHARS", "excerpt", "public_error", "sanitise_text"]

#: The excerpt's size: enough for the exception line and what the tool said just before it.
EXCERPT_LINES = 4
EXCERPT_CHARS = 600
_LINE_CHARS = 240

# An absolute host path of two or more components (/root/.cache/kiln/x/model.onnx), not part of
# a URL (s3://bucket/key, http://host/path): no ':', '/' or word character right before it.
_PATH = re.compile(r"(?<![\w:/.~-])(?:/[\w.@+~-]+){2,}/?")
# Traceback furniture: the header, frames and their source lines, carets, chaining banners.
_TRACEBACK_LINE = re.compile(
    r"^\s*(Traceback \(most recent call last\):|File \"[^\"]*\", line \d+|[~^]{3,}\s*$|\+[-=+ ]*$|\|)"
    r"|^(During handling of the above exception|The above exception was the direct cause)"
)


def sanitise_text(text: str) -> str:
    """Return ``text`` with every absolute host path replaced by its last component."""
    return _PATH.sub(lambda m: m.group(0).rstrip("/").rsplit("/", 1)[-1], text)


def excerpt(output: str) -> str:
    """Return the last few lines of ``output`` that are not traceback frames, paths cut short."""
    lines = output.splitlines()
    kept: list[str] = []
    skip_source = False
    for line in lines:
        if _TRACEBACK_LINE.search(line):
            # A frame's next indented line is its source code: leave it out too.
            skip_source = line.lstrip().startswith("File ")
            continue
        if skip_source and line.startswith((" ", "\t")):
            skip_source = False
            continue
        skip_source = False
        if line.strip():
            kept.append(sanitise_text(line.rstrip())[:_LINE_CHARS])
    text = "\n".join(kept[-EXCERPT_LINES:])
    return text[-EXCERPT_CHARS:]


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return sanitise_text(value)
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


def public_error(body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Return (the error as users see it, the raw tool output it carried for the log or None).

    Idempotent: an error already made public comes back unchanged with no output.
    """
    details = dict(body.get("details") or {})
    raw = details.pop("output_tail", None)
    if isinstance(raw, list):  # some tools report their output as lines
        raw = "\n".join(str(x) for x in raw)
    public: dict[str, Any] = {
        k: sanitise_text(v) if isinstance(v, str) else v for k, v in body.items() if k != "details"
    }
    details = _clean(details)
    if raw:
        short = excerpt(str(raw))
        if short:
            details["excerpt"] = short
    if details or "details" in body:
        public["details"] = details
    return public, (str(raw) if raw else None)
