"""Artifact store on a local directory (the embedded default and the CLI's cache)."""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.errors import NotFound
from services.storage.base import ArtifactStore
from services.storage.prune import IN_USE_LOCK

__all__ = ["LocalArtifactStore"]

_COMPLETE = ".kiln-complete"


class LocalArtifactStore(ArtifactStore):
    """Directories under ``root/<key>``, written to a temp dir then renamed into place."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _dir(self, key: str) -> Path:
        if ".." in key.split("/") or key.startswith("/"):
            raise ValueError(f"bad store key {key!r}")
        return self.root / key

    def exists(self, key: str) -> bool:
        return (self._dir(key) / _COMPLETE).exists()

    def put_dir(self, key: str, local_dir: Path, *, move: bool = False) -> str:
        final = self._dir(key)
        if self.exists(key):
            return self.uri(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex}"
        try:
            if not (move and _rename_tree(Path(local_dir), tmp)):
                shutil.copytree(local_dir, tmp)
            (tmp / _COMPLETE).touch()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a disk that filled up mid-copy keeps no half copy
            raise
        try:
            os.rename(tmp, final)
        except OSError:
            # Another writer won the race with the same content, or a stale partial dir
            # without the marker is in the way: replace only the latter.
            if self.exists(key):
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
        return self.uri(key)

    def fetch_dir(self, key: str, dest: Path) -> Path:
        src = self.local_path(key)
        if src is None:
            raise NotFound(f"artifact {key} is not in the store")
        shutil.copytree(src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(_COMPLETE))
        return dest

    def local_path(self, key: str) -> Path | None:
        marker = self._dir(key) / _COMPLETE
        try:
            os.utime(marker)  # its mtime is the entry's last use, which pruning goes by
        except FileNotFoundError:
            return None
        return marker.parent

    @contextmanager
    def in_use(self) -> Iterator[None]:
        # A shared lock: any number of jobs at once; `kiln cache prune` takes it exclusively.
        with open(self.root / IN_USE_LOCK, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def uri(self, key: str) -> str:
        return self._dir(key).resolve().as_uri()

    def delete(self, key: str) -> None:
        shutil.rmtree(self._dir(key), ignore_errors=True)


def _rename_tree(src: Path, dest: Path) -> bool:
    """Move ``src`` to ``dest`` with one rename; False when it cannot (another filesystem).

    A step's output and an upload are gigabytes for large models; a rename makes storing
    them free where the scratch space and the store share a filesystem (the defaults do).
    Symbolic links are resolved by the copy but would survive a rename pointing into
    scratch space that is about to go, so a tree holding any is copied.
    """
    if any(p.is_symlink() for p in src.rglob("*")):
        return False
    try:
        os.rename(src, dest)
    except OSError:  # EXDEV across filesystems, or anything else: copy instead
        return False
    return True
