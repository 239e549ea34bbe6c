"""Load a job's source model once per process while the job runs, not once per step.

``kiln compile`` runs every step of a job in one process, and a Keras source is read by
three of them (the reference, keras-to-savedmodel, keras-to-onnx): 1.4–1.7 s each for
ResNet-50 on this machine, the same file every time. Inside ``job_memo()`` a loader
wrapped by ``memoized`` returns what the first call built for the same file (same path,
size and modification time). Outside it (a worker's step child runs one step of a job and
then another job's) nothing is kept, so no model outlives its job in a long-lived process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["job_memo", "memoized"]

T = TypeVar("T")

#: What the running job loaded, by (kind, path, size, mtime); None when no job is in scope.
_memo: dict[tuple[Any, ...], Any] | None = None


@contextmanager
def job_memo() -> Iterator[None]:
    """Share loaded sources between the steps run inside; forget them all on the way out."""
    global _memo
    if _memo is not None:  # nested: the outer scope owns the memo
        yield
        return
    _memo = {}
    try:
        yield
    finally:
        _memo = None


def memoized(kind: str, path: Path, load: Callable[[], T]) -> T:
    """Return ``load()``, or what it returned before for this unchanged file inside the same job."""
    if _memo is None:
        return load()
    st = Path(path).stat()
    key = (kind, str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if key not in _memo:
        _memo[key] = load()
    return _memo[key]  # type: ignore[no-any-return]
