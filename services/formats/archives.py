"""Safe extraction of uploaded archives (.zip, .tar, .tar.gz, .tgz).

Python's ``tarfile`` data filter refuses links and absolute paths but not decompression
bombs, and ``zipfile`` checks neither, so both go through one checker here. Every member's
header is vetted before its bytes are read: no absolute path, no ``..``, no link or device,
a bounded name (length, and depth in folders: a member 2,000 folders deep would exhaust the
recursion of ``os.makedirs``), bounded size, and a running total bounded by the archive's
size times :attr:`ArchiveLimits.max_ratio` (and an absolute cap).

A zip's sizes come from its central directory, read before anything is inflated (and its
members are read no further than the sizes declared). A tar is a stream: its headers are
read as it is inflated once, front to back, and the first header past a limit stops the
stream, so a bomb costs at most what the limits allow to inflate, once. Listing a tar
(detection) is that same bounded pass; extraction is one more, only of an archive that
passed.
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from services.errors import SourceUnreadable, UnsafeInput

__all__ = ["ArchiveLimits", "archive_kind", "list_members", "safe_extract"]

_BOMB_HINT = "This looks like a decompression bomb; upload the model files uncompressed or smaller."


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds on what an archive may expand to."""

    max_total_bytes: int = 8 * 1024**3
    max_members: int = 100_000
    max_ratio: float = 200.0  # uncompressed / compressed, over the whole archive (past ``ratio_floor``)
    ratio_floor: int = 10 * 1024**2  # archives expanding to less than this are not judged by their ratio
    max_depth: int = 64  # folders a member may sit in
    max_name_bytes: int = 1024  # a member's whole name
    max_part_bytes: int = 255  # one folder or file name (the file system's own limit)


#: What a zip archive starts with: a member's local header, or the end record of an empty archive.
_ZIP_STARTS = (b"PK\x03\x04", b"PK\x05\x06")


def archive_kind(path: Path) -> str | None:
    """Return "zip" or "tar" when the file is such an archive (by content), else None.

    A zip is an archive only when the file starts as one. ``zipfile.is_zipfile`` looks for
    the central directory at the end, so it also says yes for a file with a zip appended:
    a TFLite model carrying TFLite metadata (MediaPipe's models, Model Maker, the metadata
    writers) is a FlatBuffer with its labels zipped after it, and is read whole as TFLite.
    """
    if not path.is_file():
        return None
    with path.open("rb") as fh:
        head = fh.read(4)
    if head in _ZIP_STARTS and zipfile.is_zipfile(path):
        return "zip"
    try:
        if tarfile.is_tarfile(path):
            return "tar"
    except (OSError, EOFError, tarfile.TarError):
        return None
    return None


def list_members(path: Path, limits: ArchiveLimits | None = None) -> list[str]:
    """Return the member names of a zip or tar archive without extracting it, checking every header.

    UNSAFE_INPUT as :func:`safe_extract` would answer (a tar is refused from the first header
    past a limit, having inflated no more than the limits allow).
    """
    limits = limits or ArchiveLimits()
    kind = archive_kind(path)
    try:
        if kind == "zip":
            with zipfile.ZipFile(path) as zf:
                return [info.filename for info in _checked_zip(zf, path, limits)]
        if kind == "tar":
            return [m.name for m, _ in _checked_tar(path, limits)]
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as exc:
        raise SourceUnreadable(f"archive {path.name} cannot be read: {exc}") from exc
    return []


def _check_name(name: str, limits: ArchiveLimits) -> None:
    p = PurePosixPath(name.replace("\\", "/"))
    if p.is_absolute() or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise UnsafeInput(f"archive member {name!r} has an absolute path", member=name)
    if ".." in p.parts:
        raise UnsafeInput(f"archive member {name!r} escapes the archive with '..'", member=name)
    size = len(name.encode("utf-8", "surrogateescape"))
    if size > limits.max_name_bytes or any(
        len(part.encode("utf-8", "surrogateescape")) > limits.max_part_bytes for part in p.parts
    ):
        raise UnsafeInput(
            f"archive member {name[:80]!r}... has a name of {size} bytes (limit {limits.max_name_bytes}, "
            f"{limits.max_part_bytes} per folder or file)",
            member=name[:200],
        )
    if len(p.parts) > limits.max_depth + 1:
        raise UnsafeInput(
            f"archive member {name[:80]!r}... sits {len(p.parts) - 1} folders deep (limit {limits.max_depth})",
            hint="Models are a few folders deep; flatten the archive.",
            member=name[:200],
        )


class _Budget:
    """The running totals of one archive against its limits."""

    def __init__(self, limits: ArchiveLimits, compressed: int) -> None:
        self.limits, self.compressed = limits, max(compressed, 1)
        self.total = self.count = 0

    def add(self, size: int) -> None:
        self.count += 1
        self.total += max(size, 0)
        limits = self.limits
        if self.count > limits.max_members:
            raise UnsafeInput(f"archive has more than {limits.max_members} members")
        if self.total > limits.max_total_bytes:
            raise UnsafeInput(
                f"archive expands to more than {limits.max_total_bytes} bytes (the limit)",
                hint=_BOMB_HINT,
            )
        if self.total > limits.ratio_floor and self.total / self.compressed > limits.max_ratio:
            raise UnsafeInput(
                f"archive expands {self.total / self.compressed:.0f}x or more (limit {limits.max_ratio:.0f}x)",
                hint=_BOMB_HINT,
            )


def _checked_zip(zf: zipfile.ZipFile, path: Path, limits: ArchiveLimits) -> list[zipfile.ZipInfo]:
    """Return the zip's members after checking every central-directory header (nothing is inflated)."""
    budget = _Budget(limits, path.stat().st_size)
    infos = zf.infolist()
    for info in infos:
        _check_name(info.filename, limits)
        mode = (info.external_attr >> 16) & 0xFFFF
        if mode and stat.S_ISLNK(mode):
            raise UnsafeInput(f"archive member {info.filename!r} is a symbolic link", member=info.filename)
        budget.add(info.file_size)
    return infos


def _checked_tar(path: Path, limits: ArchiveLimits) -> Iterator[tuple[tarfile.TarInfo, tarfile.TarFile]]:
    """Yield each member of a tar (any compression) with its stream, after checking its header, in one pass."""
    budget = _Budget(limits, path.stat().st_size)
    with tarfile.open(path, mode="r|*") as tf:  # a stream: inflated once, front to back, never sought
        for member in tf:
            _check_name(member.name, limits)
            if member.issym() or member.islnk():
                raise UnsafeInput(f"archive member {member.name!r} is a link", member=member.name)
            if not (member.isfile() or member.isdir()):
                raise UnsafeInput(f"archive member {member.name!r} is a device or special file", member=member.name)
            budget.add(member.size)
            yield member, tf


def safe_extract(path: Path, dest: Path, limits: ArchiveLimits | None = None) -> Path:
    """Extract an archive into ``dest`` after vetting every member's header; return ``dest``.

    A refusal partway through a tar removes what was written of it.
    """
    limits = limits or ArchiveLimits()
    kind = archive_kind(path)
    if kind is None:
        raise SourceUnreadable(f"{path.name} is not a readable zip or tar archive")
    dest.mkdir(parents=True, exist_ok=True)
    try:
        if kind == "zip":
            _extract_zip(path, dest, limits)
        else:
            _extract_tar(path, dest, limits)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
        raise SourceUnreadable(f"archive {path.name} is corrupt or truncated: {exc}") from exc
    return dest


def _make_parent(dest: Path, name: str) -> Path:
    """Return ``dest/name`` with its folders made one by one (no recursion; the depth is bounded anyway)."""
    target = dest
    parts = PurePosixPath(name.replace("\\", "/")).parts
    for part in parts[:-1]:
        target = target / part
        if not target.is_dir():
            target.mkdir(exist_ok=True)
    return target / parts[-1] if parts else target


def _extract_zip(path: Path, dest: Path, limits: ArchiveLimits) -> None:
    with zipfile.ZipFile(path) as zf:
        for info in _checked_zip(zf, path, limits):  # every header checked first: nothing written for a refused zip
            target = _make_parent(dest, info.filename)
            if info.is_dir():
                target.mkdir(exist_ok=True)
                continue
            # zipfile reads a member no further than its declared size (checked above), and its CRC.
            with zf.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)


def _extract_tar(path: Path, dest: Path, limits: ArchiveLimits) -> None:
    try:
        for member, tf in _checked_tar(path, limits):
            target = _make_parent(dest, member.name)
            if member.isdir():
                target.mkdir(exist_ok=True)
                continue
            src = tf.extractfile(member)
            if src is None:
                raise UnsafeInput(f"archive member {member.name!r} has no data", member=member.name)
            # Modes as the "data" filter would leave them: no set-id bits, owner may read and write.
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    except UnsafeInput:
        shutil.rmtree(dest, ignore_errors=True)
        raise
