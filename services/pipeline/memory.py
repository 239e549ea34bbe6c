"""Peak resident memory of this process over one step.

``getrusage``'s ``ru_maxrss`` only ever grows, so in a process that runs several steps (the
in-process ``kiln compile``, a reused step child) it would charge every later step with the
largest earlier one. Linux keeps the same high-water mark as ``VmHWM`` and lets a process
reset it (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0), which gives each step its own
peak without a sampling thread. Elsewhere the lifetime ``ru_maxrss`` is the fallback, and
the record says which one it is.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

__all__ = ["StepMemory", "peak_rss_bytes", "reset_peak_rss", "rss_bytes"]

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark to its current RSS; False where the OS does not allow it."""
    try:
        with open(_CLEAR_REFS, "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_bytes() -> int:
    """Return this process's peak RSS since the last reset (or since it started), in bytes."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # macOS reports bytes, Linux KiB


def rss_bytes() -> int:
    """Return this process's resident memory now, in bytes (0 where unknown)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else 0


@dataclass
class StepMemory:
    """Memory of one step: RSS when it started and the process's peak while it ran."""

    rss_before: int
    per_step: bool  # False: the peak is the process's lifetime peak (no reset possible)

    @classmethod
    def start(cls) -> StepMemory:
        return cls(rss_before=rss_bytes(), per_step=reset_peak_rss())

    def record(self) -> dict[str, float | bool]:
        """Return the fields the step's lineage record carries (MiB, rounded)."""
        mib = 1 << 20
        out: dict[str, float | bool] = {
            "peak_rss_mb": round(peak_rss_bytes() / mib, 1),
            "rss_before_mb": round(self.rss_before / mib, 1),
        }
        if not self.per_step:
            out["peak_rss_is_lifetime"] = True
        return out
