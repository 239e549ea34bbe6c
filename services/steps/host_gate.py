"""Benchmarks time an artifact alone on its machine: steps share the host, a benchmark excludes.

Under ``kiln serve`` a worker runs two steps at once; a benchmark timed while a converter ran
beside it had a p99 30x its p50, numbers nobody should size a deployment with. So every step
holds a *share* of the host while it runs, and the timing part of an export (its benchmark and
its fp32 comparison) takes the host *alone*: it waits until the running steps finish and
holds new ones back until it is done.

No library offers a cross-process reader/writer lock with writer preference and a bounded
wait, so it is written here on ``fcntl.flock`` (advisory locks that the kernel drops when a
process dies, so a killed step never leaves the host locked):

- ``host.lock``: steps hold it shared, a benchmark exclusive;
- ``turnstile.lock``: taken exclusively by a step for an instant before it takes its share,
  and by a benchmark for as long as it waits and runs, so a stream of new steps cannot
  starve a waiting benchmark.

A benchmark waits at most ``KILN_BENCH_QUIET_WAIT`` seconds for the host to be quiet; then it
runs anyway and says so (``alone: false`` in its benchmark rows), rather than stall a job
behind a long conversion. The locks live in ``KILN_HOST_LOCK_DIR`` (default: a directory in
the system's temp dir), so workers that share that directory — the processes of one
container, or containers that mount the same host path — take turns.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.settings import BENCH_QUIET_WAIT

__all__ = ["QuietHost", "host_alone", "host_share"]

_POLL = 0.05


def _lock_dir() -> Path:
    configured = os.environ.get("KILN_HOST_LOCK_DIR")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"kiln-host-{os.getuid()}"


def _quiet_wait() -> float:
    try:
        return max(0.0, float(os.environ.get("KILN_BENCH_QUIET_WAIT", BENCH_QUIET_WAIT)))
    except ValueError:
        return BENCH_QUIET_WAIT


def _open(name: str) -> int:
    directory = _lock_dir()
    directory.mkdir(parents=True, exist_ok=True)
    # One open file description per use: flock locks belong to it, so two threads (or a
    # thread and itself, re-entering) never mistake each other's lock for their own.
    return os.open(directory / name, os.O_RDWR | os.O_CREAT, 0o666)


def _flock_until(fd: int, op: int, deadline: float | None) -> bool:
    """Take ``op`` on ``fd``, waiting until ``deadline`` (monotonic; None: forever)."""
    if deadline is None:
        fcntl.flock(fd, op)
        return True
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL)


class _Share:
    """This thread's share of the host while one of its steps runs."""

    def __init__(self) -> None:
        self.fd: int | None = None

    def take(self) -> None:
        turnstile = _open("turnstile.lock")
        try:
            fcntl.flock(turnstile, fcntl.LOCK_EX)  # waits while a benchmark waits or runs
            self.fd = _open("host.lock")
            fcntl.flock(self.fd, fcntl.LOCK_SH)
        finally:
            os.close(turnstile)  # closing drops the turnstile lock

    def drop(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


_local = threading.local()


@contextlib.contextmanager
def host_share() -> Iterator[None]:
    """Hold a share of the host while a step runs (re-entrant within a thread)."""
    if getattr(_local, "share", None) is not None:
        yield
        return
    share = _Share()
    share.take()
    _local.share = share
    try:
        yield
    finally:
        _local.share = None
        share.drop()


@dataclass
class QuietHost:
    """What :func:`host_alone` got: the host alone or not, and how long it waited."""

    alone: bool
    waited_s: float


@contextlib.contextmanager
def host_alone(max_wait: float | None = None) -> Iterator[QuietHost]:
    """Run the block with no other step running on this host, waiting at most ``max_wait`` s.

    The calling step's own share is set down meanwhile (it would otherwise wait on itself)
    and taken back after.
    """
    wait = _quiet_wait() if max_wait is None else max_wait
    own: _Share | None = getattr(_local, "share", None)
    if own is not None:
        own.drop()
    t0 = time.monotonic()
    deadline = t0 + wait
    turnstile = _open("turnstile.lock")
    host = _open("host.lock")
    try:
        alone = _flock_until(turnstile, fcntl.LOCK_EX, deadline) and _flock_until(host, fcntl.LOCK_EX, deadline)
        yield QuietHost(alone=alone, waited_s=round(time.monotonic() - t0, 3))
    finally:
        os.close(host)
        os.close(turnstile)
        if own is not None:
            own.take()
