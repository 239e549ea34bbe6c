"""Safe extraction of uploaded archives (.zip, .tar, .tar.gz, .tgz).

Python's ``tarfile`` data filter refuses links and absolute paths but not decompression
bombs, and ``zipfile`` checks neither, so both go through one checker here: every member
is vetted (no absolute path, no ``..``, no link or device, bounded total and per-member
size, bounded compression ratio) before a single byte is written.
"""

from __future__ import annotations

import stat
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from services.errors import SourceUnreadable, UnsafeInput

__all__ = ["ArchiveLimits", "archive_kind", "list_members", "safe_extract"]


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds on what an archive may expand to."""

    max_total_bytes: int = 8 * 1024**3
    max_members: int = 100_000
    max_ratio: float = 200.0  # uncompressed / compressed, over the whole archive


def archive_kind(path: Path) -> str | None:
    """Return "zip" or "tar" when the file is such an archive (by content), else None."""
    if not path.is_file():
        return None
    if zipfile.is_zipfile(path):
        return "zip"
    try:
        if tarfile.is_tarfile(path):
            return "tar"
    except (OSError, EOFError, tarfile.TarError):
        return None
    return None


def list_members(path: Path) -> list[str]:
    """Return the member names of a zip or tar archive without extracting it."""
    kind = archive_kind(path)
    try:
        if kind == "zip":
            with zipfile.ZipFile(path) as zf:
                return zf.namelist()
        if kind == "tar":
            with tarfile.open(path) as tf:
                return tf.getnames()
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as exc:
        raise SourceUnreadable(f"archive {path.name} cannot be read: {exc}") from exc
    return []


def _check_name(name: str) -> None:
    p = PurePosixPath(name.replace("\\", "/"))
    if p.is_absolute() or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise UnsafeInput(f"archive member {name!r} has an absolute path", member=name)
    if ".." in p.parts:
        raise UnsafeInput(f"archive member {name!r} escapes the archive with '..'", member=name)


def safe_extract(path: Path, dest: Path, limits: ArchiveLimits | None = None) -> Path:
    """Extract an archive into ``dest`` after vetting every member; return ``dest``."""
    limits = limits or ArchiveLimits()
    kind = archive_kind(path)
    if kind is None:
        raise SourceUnreadable(f"{path.name} is not a readable zip or tar archive")
    compressed = max(path.stat().st_size, 1)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        if kind == "zip":
            _extract_zip(path, dest, limits, compressed)
        else:
            _extract_tar(path, dest, limits, compressed)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
        raise SourceUnreadable(f"archive {path.name} is corrupt or truncated: {exc}") from exc
    return dest


def _check_totals(total: int, count: int, limits: ArchiveLimits, compressed: int) -> None:
    if count > limits.max_members:
        raise UnsafeInput(f"archive has more than {limits.max_members} members")
    if total > limits.max_total_bytes:
        raise UnsafeInput(
            f"archive expands to {total} bytes, over the {limits.max_total_bytes}-byte limit",
            hint="This looks like a decompression bomb; upload the model files uncompressed or smaller.",
        )
    if total > 10 * 1024**2 and total / compressed > limits.max_ratio:
        raise UnsafeInput(
            f"archive expands {total / compressed:.0f}x (limit {limits.max_ratio:.0f}x)",
            hint="This looks like a decompression bomb; models rarely compress that well.",
        )


def _extract_zip(path: Path, dest: Path, limits: ArchiveLimits, compressed: int) -> None:
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        total = 0
        for info in infos:
            _check_name(info.filename)
            mode = (info.external_attr >> 16) & 0xFFFF
            if mode and stat.S_ISLNK(mode):
                raise UnsafeInput(f"archive member {info.filename!r} is a symbolic link", member=info.filename)
            total += info.file_size
        _check_totals(total, len(infos), limits, compressed)
        # The declared sizes can lie; count real bytes while writing as well.
        written = 0
        for info in infos:
            target = dest / info.filename
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                while chunk := src.read(1 << 20):
                    written += len(chunk)
                    if written > limits.max_total_bytes:
                        raise UnsafeInput("archive expands past its declared size", hint="Decompression bomb refused.")
                    out.write(chunk)


def _extract_tar(path: Path, dest: Path, limits: ArchiveLimits, compressed: int) -> None:
    with tarfile.open(path) as tf:
        members = tf.getmembers()
        total = 0
        for m in members:
            _check_name(m.name)
            if m.issym() or m.islnk():
                raise UnsafeInput(f"archive member {m.name!r} is a link", member=m.name)
            if not (m.isfile() or m.isdir()):
                raise UnsafeInput(f"archive member {m.name!r} is a device or special file", member=m.name)
            total += m.size
        _check_totals(total, len(members), limits, compressed)
        # The "data" filter re-checks paths and strips unsafe modes as a second line of defence.
        tf.extractall(dest, members=members, filter="data")
