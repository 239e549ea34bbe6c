"""The CPU this process runs on, as LLVM names it, and the threads TVM's runtime runs on, read without importing TVM."""

from __future__ import annotations

import hashlib
import os
import platform
from functools import cache
from pathlib import Path

__all__ = ["configure_threads", "cpu_fingerprint", "host_versions", "physical_cores"]


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


def physical_cores() -> int:
    """Return the physical cores among the CPUs this process may run on (its affinity mask).

    Hyper-threads of one core share its vector units, so a compute-bound kernel gains nothing from
    the second; a CPU whose topology /sys does not show counts as a core of its own.
    """
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(
                (topology / "physical_package_id").read_text().strip()
                + ":"
                + (topology / "core_id").read_text().strip()
            )
        except OSError:
            cores.add(f"cpu{cpu}")
    return max(1, len(cores))


def configure_threads() -> int:
    """Size TVM's CPU thread pool (``TVM_NUM_THREADS``) before TVM creates it; return the size.

    TVM's runtime sizes its pool at half the logical CPUs on x86, assuming two hyper-threads per
    core, and cannot grow it later. Where each core has one thread (VMs, containers given N CPUs)
    that leaves half the cores idle: on a 2-core worker the pool had 1 thread, and MetaSchedule
    timed its candidates on it too; one thread per physical core made a tuned transformer block
    2.2x faster (docs/benchmarks.md). ``TVM_NUM_THREADS`` set by the operator is kept.
    """
    given = os.environ.get("TVM_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    threads = physical_cores()
    os.environ["TVM_NUM_THREADS"] = str(threads)
    return threads
