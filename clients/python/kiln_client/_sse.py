"""A Server-Sent Events parser for ``GET /jobs/{id}/events`` (the parts of the format Kiln uses)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from kiln_client._models import Event, parse_time

__all__ = ["parse_events"]


def parse_events(lines: Iterable[str]) -> Iterator[Event]:
    """Yield each event of an SSE stream given as lines (comments and ``retry:`` are skipped)."""
    event_id: str | None = None
    kind = "message"
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:  # a blank line ends an event
            if data:
                yield _event(event_id, kind, "\n".join(data))
            event_id, kind, data = None, "message", []
            continue
        if line.startswith(":"):
            continue  # a comment: the server's keep-alive
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id":
            event_id = value
        elif name == "event":
            kind = value
        elif name == "data":
            data.append(value)
    # A stream cut mid-event drops that event: it is sent again after a resume.


def _event(event_id: str | None, kind: str, text: str) -> Event:
    try:
        body: Any = json.loads(text)
    except json.JSONDecodeError:
        body = {"message": text}
    if not isinstance(body, dict):
        body = {"value": body}
    return Event(
        id=int(event_id) if event_id and event_id.isdigit() else 0,
        type=str(body.get("type") or kind),
        step=body.get("step"),
        at=parse_time(body.get("at")),
        data=body,
    )
