"""Give a confined step its own job's inputs, and nothing else of the artifact store or the fetch cache.

A step reads its source, its input artifacts and its calibration or evaluation data from
files the worker fetched. Binding the store and the fetch cache into the sandbox would show
every step every other job's uploads (issue 31: a TorchScript model read another tenant's
model with ``torch.from_file("<cache>/store/sources/<sha256>/...")``). Instead the worker
links the files of this step's inputs into the step process's own folder of the inputs area,
which bubblewrap binds read-only and Landlock lets only that process read: hard links (no
copy, microseconds per file), or copies where the store lies on another file system. The
links are read-only to the step (a read-only mount, or a read-only Landlock rule), so a
step cannot change the store's files through them.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["StagedInputs", "link_tree"]


def _link_file(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES):
            raise
        shutil.copyfile(src, dest)  # another file system (or links refused): a private copy


def link_tree(src: Path, dest: Path) -> Path:
    """Put ``src`` (a file or a folder) at ``dest`` as hard links to its files; return ``dest``.

    Links inside a folder are recreated as they are (artifacts hold only links within themselves,
    services/sandbox/outputs.py); nothing is followed.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not src.is_dir():
        _link_file(src, dest)
        return dest
    dest.mkdir(exist_ok=True)
    for folder, dirs, files in os.walk(src):
        rel = Path(folder).relative_to(src)
        for name in dirs:
            path = Path(folder) / name
            if path.is_symlink():
                os.symlink(os.readlink(path), dest / rel / name)
            else:
                (dest / rel / name).mkdir(exist_ok=True)
        for name in files:
            path = Path(folder) / name
            if path.is_symlink():
                os.symlink(os.readlink(path), dest / rel / name)
            else:
                _link_file(path, dest / rel / name)
    return dest


class StagedInputs:
    """A step's inputs, linked into ``root`` (the step process's own folder of the inputs area)."""

    def __init__(self, root: Path, own: Path) -> None:
        self.root, self.own = root, own  # ``own``: what the process may read anyway (its writable folder)
        self._n = 0
        self._done: dict[Path, Path] = {}

    def path(self, src: Path) -> Path:
        """Return where the step reads ``src``: itself when it is in the process's own folder, else a link of it."""
        src = Path(src)
        if src == self.own or self.own in src.parents:
            return src
        if src not in self._done:
            self._n += 1
            self._done[src] = link_tree(src, self.root / str(self._n) / src.name)
        return self._done[src]

    def source(self, source: Any) -> Any:
        """Return the DetectedSource with its path in the step's view."""
        return dataclasses.replace(source, path=self.path(source.path))

    def artifact(self, art: Any) -> Any:
        """Return the Artifact with its root in the step's view."""
        return dataclasses.replace(art, root=self.path(art.root))

    def extras(self, extras: dict[str, Any]) -> dict[str, Any]:
        """Return the step's extras with every file path in it (calibration, evaluation data) in the step's view."""
        return {k: self.path(v) if isinstance(v, Path) and v.exists() else v for k, v in extras.items()}
