"""Pruning a local artifact store (the cache) by age and size, without pulling entries from under jobs.

Every job (``kiln compile``) and every step a worker runs holds a shared lock on
``<store>/.kiln-in-use`` while it reads and writes the store (:meth:`LocalArtifactStore.in_use`);
pruning takes the exclusive lock, so it runs only between jobs and waits (up to ``wait``
seconds) for running ones. An entry's last use is its completion marker's mtime, which
``local_path`` touches on every read, so least-recently-used entries go first.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.errors import InvalidSpec, ServiceUnavailable

__all__ = ["IN_USE_LOCK", "PruneReport", "parse_age", "parse_size", "prune_store", "store_entries"]

IN_USE_LOCK = ".kiln-in-use"
_COMPLETE = ".kiln-complete"
#: Half-written entries (``.tmp-*``) older than this belong to a crashed writer.
_STALE_TMP_SECONDS = 24 * 3600


@dataclass
class PruneReport:
    """What a prune removed and what is left."""

    removed: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    kept: int = 0
    kept_bytes: int = 0
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "removed": self.removed,
            "freed_bytes": self.freed_bytes,
            "kept": self.kept,
            "kept_bytes": self.kept_bytes,
            "dry_run": self.dry_run,
        }


@dataclass(frozen=True)
class _Entry:
    key: str
    path: Path
    last_used: float
    size: int


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def store_entries(root: Path) -> list[_Entry]:
    """Return the store's complete entries, least recently used first."""
    out = []
    for marker in root.rglob(_COMPLETE):
        entry = marker.parent
        if any(part.startswith(".") for part in entry.relative_to(root).parts):
            continue  # a temp or trash directory, not an entry
        out.append(_Entry(entry.relative_to(root).as_posix(), entry, marker.stat().st_mtime, _tree_size(entry)))
    return sorted(out, key=lambda e: (e.last_used, e.key))


def _remove(root: Path, path: Path) -> None:
    # Renamed away first (atomic), so no reader ever finds a half-deleted entry under its key.
    trash = root / f".trash-{uuid.uuid4().hex}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _lock_exclusive(fh: Any, wait: float) -> None:
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise ServiceUnavailable(
                    "the cache is in use by a running job",
                    hint="Retry when it finishes, or give --wait SECONDS to wait for it.",
                ) from None
            time.sleep(0.2)


def prune_store(
    root: Path,
    *,
    older_than: float | None = None,
    max_bytes: int | None = None,
    dry_run: bool = False,
    wait: float = 0.0,
    now: float | None = None,
) -> PruneReport:
    """Remove entries unused for ``older_than`` seconds, then least recently used ones until under ``max_bytes``.

    Raises SERVICE_UNAVAILABLE when a job holds the store for longer than ``wait`` seconds.
    """
    root = Path(root)
    report = PruneReport(dry_run=dry_run)
    if not root.is_dir():
        return report
    now = time.time() if now is None else now
    with open(root / IN_USE_LOCK, "a") as fh:
        _lock_exclusive(fh, wait)
        try:
            entries = store_entries(root)
            total = sum(e.size for e in entries)
            for e in entries:
                too_old = older_than is not None and now - e.last_used > older_than
                too_big = max_bytes is not None and total > max_bytes
                if not (too_old or too_big):
                    report.kept += 1
                    report.kept_bytes += e.size
                    continue
                if not dry_run:
                    _remove(root, e.path)
                report.removed.append(e.key)
                report.freed_bytes += e.size
                total -= e.size
            if not dry_run:
                for tmp in root.rglob(".tmp-*"):
                    if tmp.is_dir() and now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                        shutil.rmtree(tmp, ignore_errors=True)
                for trash in root.glob(".trash-*"):
                    shutil.rmtree(trash, ignore_errors=True)
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
    return report


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}  # fmt: skip
_SPANS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """Return bytes from ``500MB``, ``10GiB``, ``2g`` or a plain number."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidSpec(f"{text!r} is not a size", hint="Write e.g. 500MB, 10GB or 2GiB.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_age(text: str) -> float:
    """Return seconds from ``30m``, ``12h``, ``7d`` or ``2w``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text.lower())
    if not m:
        raise InvalidSpec(f"{text!r} is not an age", hint="Write e.g. 30m, 12h, 7d or 2w.")
    return float(m.group(1)) * _SPANS[m.group(2)]
