"""The model repository interface: primitives each backend implements, publishing on top.

Backends (local directory here, S3 in the service) implement a handful of primitives;
:func:`services.repository.publish.publish_version` builds the atomic publish on them, so
every backend publishes the same way.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.repository.signing_keys import SigningKey

__all__ = ["ModelRepository"]


class ModelRepository(abc.ABC):
    """A tree of ``<root>/<name>/<version>/...`` that serving engines read as-is."""

    #: The path at which serving engines see this repository (e.g. ``/models`` in a container),
    #: for base_path in TF Serving's and OVMS's configs; empty = the repository's own location.
    serving_root: str = ""
    #: The key every version published here is signed with (services/repository/signing.py); the
    #: factory that builds a repository from the settings sets it. None = versions go unsigned.
    signing_key: SigningKey | None = None

    @abc.abstractmethod
    def lock(self) -> AbstractContextManager[None]:
        """Return a context manager that serialises publishers of this repository."""

    @abc.abstractmethod
    def model_names(self, under: str = "") -> list[str]:
        """Return the names of the model directories under ``under`` (a root), sorted."""

    @abc.abstractmethod
    def versions(self, name: str) -> list[int]:
        """Return the complete versions of ``name``, ascending."""

    @abc.abstractmethod
    def write_version(self, name: str, version: int, local_dir: Path) -> None:
        """Make ``local_dir``'s files appear as ``<name>/<version>/`` all at once."""

    @abc.abstractmethod
    def read_file(self, relpath: str) -> bytes | None:
        """Return the bytes at ``relpath`` (relative to the repository root), or None."""

    @abc.abstractmethod
    def write_file(self, relpath: str, data: bytes) -> None:
        """Replace the file at ``relpath`` atomically (readers see old or new bytes)."""

    @abc.abstractmethod
    def uri(self, relpath: str = "") -> str:
        """Return a URI for ``relpath`` within the repository."""

    @abc.abstractmethod
    def fetch_version(self, name: str, version: int, dest: Path) -> Path:
        """Copy ``<name>/<version>/`` into ``dest``; return ``dest``."""

    @abc.abstractmethod
    def download_dir(self, relpath: str, dest: Path) -> int:
        """Copy every file under ``relpath`` into ``dest``, complete version or not; return how many."""

    @abc.abstractmethod
    def version_fingerprint(self, model_dir: str, version: int) -> tuple[tuple[str, ...], ...]:
        """Return what changes whenever a file of ``<model_dir>/<version>/`` does (names, sizes, change stamps)."""

    def local_dir(self, relpath: str) -> Path | None:
        """Return the directory ``relpath`` is on this machine's file system, None when it is not (S3)."""
        return None

    def base_path(self, model_dir: str) -> str:
        """Return the path a server's config names for ``model_dir`` (TF Serving, OVMS)."""
        return self.uri(model_dir)

    def iter_versions(self, under: str = "") -> Iterator[tuple[str, int]]:
        for name in self.model_names(under):
            for v in self.versions(f"{under}/{name}" if under else name):
                yield name, v
