"""TensorRT timing caches on disk, one per GPU architecture and TensorRT version, shared safely.

Tactic timing is most of a build's time; the cache lets later builds on the same kind of GPU
skip it. A cache is only valid for the architecture and TensorRT release that wrote it, so
both are in the file name: ``<cache_dir>/tensorrt/timing-sm86-trt10.13.3.9.cache``. Several
builds (worker processes, pods on a shared volume) may finish at once: each one merges its
cache into whatever is on disk under a file lock and replaces the file atomically, so no
build's timings are lost and no reader sees half a file.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from services.tensorrt.device import sm_tag

__all__ = ["TimingCacheFile", "timing_cache_path"]

#: Seconds to wait for another build to finish writing the cache before giving up on it.
LOCK_TIMEOUT = 120


def timing_cache_path(cache_dir: Path, compute_capability: str, tensorrt_version: str) -> Path:
    """Return where the timing cache for this GPU architecture and TensorRT version lives."""
    return Path(cache_dir) / "tensorrt" / f"timing-{sm_tag(compute_capability)}-trt{tensorrt_version}.cache"


def _bytes(buffer: Any) -> bytes:
    # TensorRT returns IHostMemory, which exposes the buffer protocol.
    return bytes(memoryview(buffer))


@dataclass
class TimingCacheFile:
    """One timing cache file: load it before a build, merge the build's timings back after."""

    path: Path
    loaded_bytes: int = 0

    @property
    def _lock(self) -> FileLock:
        return FileLock(str(self.path) + ".lock", timeout=LOCK_TIMEOUT)

    def load(self) -> bytes:
        """Return the cache's bytes (empty when there is none yet)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            data = self.path.read_bytes() if self.path.exists() else b""
        self.loaded_bytes = len(data)
        return data

    def store(self, config: Any, cache: Any, *, loaded: bytes) -> int:
        """Merge ``cache`` (an ITimingCache) into the file and return the bytes written.

        When another build replaced the file since :meth:`load`, its timings are combined
        with ours (``ITimingCache.combine``) instead of being overwritten.
        """
        with self._lock:
            current = self.path.read_bytes() if self.path.exists() else b""
            if current and current != loaded:
                on_disk = config.create_timing_cache(current)
                # ignore_mismatch=True: merge even when the headers differ (another GPU of this architecture).
                on_disk.combine(cache, True)
                data = _bytes(on_disk.serialize())
            else:
                data = _bytes(cache.serialize())
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return len(data)
