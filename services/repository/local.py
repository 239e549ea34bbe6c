"""Model repository on a local directory."""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.errors import NotFound
from services.repository.base import ModelRepository

__all__ = ["LocalModelRepository"]


class LocalModelRepository(ModelRepository):
    """``root/<name>/<version>/``; versions appear by rename, files by write-then-rename."""

    def __init__(self, root: Path, *, serving_root: str = "") -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.serving_root = serving_root

    @contextmanager
    def lock(self) -> Iterator[None]:
        # An advisory file lock: publishers in other processes (workers) wait their turn.
        with open(self.root / ".kiln-lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def model_names(self, under: str = "") -> list[str]:
        d = self.root / under
        if not d.is_dir():
            return []
        return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))

    def versions(self, name: str) -> list[int]:
        d = self.root / name
        if not d.is_dir():
            return []
        return sorted(int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit())

    def write_version(self, name: str, version: int, local_dir: Path) -> None:
        model_dir = self.root / name
        model_dir.mkdir(parents=True, exist_ok=True)
        # Hidden temp dir in the same directory, so the final rename is atomic and servers
        # scanning for numeric version dirs never see it half-written.
        tmp = model_dir / f".tmp-{version}-{uuid.uuid4().hex}"
        try:
            shutil.copytree(local_dir, tmp)
            os.rename(tmp, model_dir / str(version))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # e.g. the disk filled up mid-copy: keep no half version
            raise

    def read_file(self, relpath: str) -> bytes | None:
        p = self.root / relpath
        return p.read_bytes() if p.is_file() else None

    def write_file(self, relpath: str, data: bytes) -> None:
        p = self.root / relpath
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.parent / f".tmp-{p.name}-{uuid.uuid4().hex}"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def uri(self, relpath: str = "") -> str:
        return str(self.root / relpath) if relpath else str(self.root)

    def fetch_version(self, name: str, version: int, dest: Path) -> Path:
        src = self.root / name / str(version)
        if not src.is_dir():
            raise NotFound(f"model {name} version {version} is not in the repository")
        shutil.copytree(src, dest, dirs_exist_ok=True)
        return dest

    def local_dir(self, relpath: str) -> Path | None:
        return self.root / relpath

    def download_dir(self, relpath: str, dest: Path) -> int:
        src = self.root / relpath
        if not src.is_dir():
            raise NotFound(f"{src} is not a directory")
        shutil.copytree(src, dest, dirs_exist_ok=True, symlinks=True)
        return sum(1 for p in Path(dest).rglob("*") if p.is_file())

    def version_fingerprint(self, model_dir: str, version: int) -> tuple[tuple[str, ...], ...]:
        # ctime and the inode as well as mtime: mtime can be set back (touch -r), ctime cannot,
        # and a file swapped in by rename has another inode.
        vdir = self.root / model_dir / str(version)
        out = []
        for p in sorted(vdir.rglob("*")):
            st = p.lstat()
            out.append(
                (
                    p.relative_to(vdir).as_posix(),
                    str(st.st_size),
                    str(st.st_mtime_ns),
                    str(st.st_ctime_ns),
                    str(st.st_ino),
                )
            )
        return tuple(out)
