"""The API process's scratch directory, and the removal of what dead API processes left.

Uploads stream into temporary files, detection unpacks archives and downloads build tars,
all under one directory per API process: ``<cache_dir>/api/run-<id>/``. A process that
crashes (SIGKILL, OOM, power) leaves its directory behind, possibly gigabytes of a half-read
upload. Each process holds an exclusive ``flock`` on ``run-<id>.lock`` for its lifetime and the
kernel drops it when the process dies however it dies, so a starting process can tell a
dead sibling's directory (lock free) from a live one's (lock held) on the same cache dir —
several API processes may share it — and removes only the dead ones'.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import IO

__all__ = ["ApiScratch"]

log = logging.getLogger("kiln.api")

#: Directories of the layout before per-process scratch (one process only could use it).
_LEGACY = ("uploads", "detect", "downloads")


def _try_lock(path: Path) -> IO[str] | None:
    """Return ``path`` opened and exclusively locked, or None when another process holds it."""
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        return None
    # Locked, but a sweeper may have unlinked the file between our open and flock: then the
    # lock guards nothing. Only a lock on the file that is at ``path`` now counts.
    try:
        same = os.fstat(fh.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        fh.close()
        return None
    return fh


class ApiScratch:
    """One API process's scratch directory (``self.dir``); ``removed`` lists what it swept at start."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.removed = self._sweep()
        while True:
            name = f"run-{uuid.uuid4().hex[:12]}"
            lock = _try_lock(root / f"{name}.lock")
            if lock is not None:
                break
        self._lock: IO[str] | None = lock
        self.dir = root / name
        self.dir.mkdir()

    def _sweep(self) -> list[str]:
        removed = []
        for lock_path in sorted(self.root.glob("run-*.lock")):
            fh = _try_lock(lock_path)
            if fh is None:
                continue  # a live process's, or one just made by a process starting now
            try:
                shutil.rmtree(lock_path.with_suffix(""), ignore_errors=True)
                lock_path.unlink(missing_ok=True)  # still holding the lock: nobody reuses it meanwhile
                removed.append(lock_path.stem)
            finally:
                fh.close()
        # A directory without its lock file: a sweep that died between the two removals.
        for path in self.root.glob("run-*"):
            if path.is_dir() and not path.with_suffix(".lock").exists():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        for name in _LEGACY:
            if (self.root / name).is_dir():
                shutil.rmtree(self.root / name, ignore_errors=True)
                removed.append(name)
        if removed:
            log.warning("removed the scratch files of %d API process(es) that did not stop cleanly", len(removed))
        return removed

    def close(self) -> None:
        """Remove this process's scratch directory and release its lock."""
        if self._lock is None:
            return
        shutil.rmtree(self.dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (self.root / f"{self.dir.name}.lock").unlink()
        self._lock.close()
        self._lock = None
