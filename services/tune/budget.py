"""The search's time budget: ``--budget 10m`` and the deadline every phase checks."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from services.errors import InvalidSpec

__all__ = ["Deadline", "parse_budget"]

_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_budget(text: str) -> float:
    """Return the seconds of a budget written ``90s``, ``10m``, ``1.5h`` or a bare number of seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text.lower())
    if m is None or float(m.group(1)) <= 0:
        raise InvalidSpec(f"budget {text!r} is not a duration", hint="Write e.g. 90s, 10m or 1h.")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


@dataclass
class Deadline:
    """A monotonic deadline (None: no budget); ``started`` is when the search began."""

    seconds: float | None
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        """Return the seconds left (infinity without a budget)."""
        if self.seconds is None:
            return float("inf")
        return self.seconds - (time.monotonic() - self.started)

    def passed(self) -> bool:
        return self.left() <= 0

    def elapsed(self) -> float:
        return time.monotonic() - self.started
