"""The CPU this process runs on, as LLVM names it, read without importing TVM."""

from __future__ import annotations

import hashlib
import platform
from functools import cache
from pathlib import Path

__all__ = ["cpu_fingerprint", "host_versions"]


@cache
def cpu_fingerprint() -> str:
    """Return a stable id of this host's CPU (model and feature flags) for cache keys.

    A library compiled for the host's ``mcpu`` may use instructions another CPU lacks, so
    the export step's content address carries the CPU it was built on.
    """
    model, flags = platform.machine(), ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model") and model == platform.machine():
                model = f"{platform.machine()} {value.strip()}"
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{model} (flags {digest})"


def host_versions() -> dict[str, str]:
    """Return the tvm engine's extra tool versions (its descriptor's ``extra_versions``): the host CPU."""
    return {"host_cpu": cpu_fingerprint()}
