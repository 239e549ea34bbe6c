"""The artifact store interface every backend (local directory, S3) implements."""

from __future__ import annotations

import abc
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

__all__ = ["ArtifactStore"]


class ArtifactStore(abc.ABC):
    """Content-addressed storage of directories under string keys.

    Keys are opaque strings such as ``steps/<sha256>`` or ``sources/<sha256>``. A key is
    written once; ``put_dir`` of an existing key is a no-op, so concurrent writers of the
    same content agree. Readers never see a partial directory: backends publish a marker
    last and ``exists`` checks the marker.
    """

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Return True when ``key`` holds a complete directory."""

    @abc.abstractmethod
    def put_dir(self, key: str, local_dir: Path, *, move: bool = False) -> str:
        """Store the contents of ``local_dir`` under ``key``; return its URI.

        ``move``: the caller discards ``local_dir`` afterwards, so a backend may take it
        over instead of copying it (``local_dir`` is then gone). Backends that cannot
        (another filesystem, object storage) copy, and leave ``local_dir`` in place.
        """

    @abc.abstractmethod
    def fetch_dir(self, key: str, dest: Path) -> Path:
        """Copy ``key``'s directory into ``dest`` (created); return ``dest``."""

    @abc.abstractmethod
    def uri(self, key: str) -> str:
        """Return a URI naming ``key`` for humans and manifests."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    def local_path(self, key: str) -> Path | None:
        """Return a local path to ``key`` when the backend has one (avoids a copy), else None."""
        return None

    def in_use(self) -> AbstractContextManager[None]:
        """Return a context manager held while a job reads and writes the store (pruning waits for it)."""
        return nullcontext()
