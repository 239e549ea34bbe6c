"""Tell a backing service that is not answering (database, broker, storage) from a bug.

The API answers the first with 503 SERVICE_UNAVAILABLE (as /readyz does) and the second with
500 INTERNAL. The client libraries are looked up in ``sys.modules`` rather than imported: an
exception can only be one of their types when the library is already loaded, and importing
boto3 or redis just to ask would cost every process that never uses them.
"""

from __future__ import annotations

import errno
import shutil
import sys
from collections.abc import Iterator

__all__ = ["backing_service_down", "storage_full"]

# (module, class names, which service) — the errors that mean "could not reach it", not "it
# said no": a refused connection, a dropped one, a pool or socket timeout.
_OUTAGES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("sqlalchemy.exc", ("OperationalError", "InterfaceError", "TimeoutError"), "database"),
    ("psycopg", ("OperationalError", "InterfaceError"), "database"),
    ("sqlite3", ("OperationalError",), "database"),
    ("redis.exceptions", ("ConnectionError", "TimeoutError", "BusyLoadingError"), "broker"),
    ("kombu.exceptions", ("OperationalError",), "broker"),
    (
        "botocore.exceptions",
        ("EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError", "ReadTimeoutError"),
        "storage",
    ),
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def backing_service_down(exc: BaseException) -> str | None:
    """Return the service (``database``, ``broker``, ``storage``) ``exc`` says is unreachable, or None."""
    for err in _chain(exc):
        for module_name, names, service in _OUTAGES:
            module = sys.modules.get(module_name)
            if module is None:
                continue
            types = tuple(t for t in (getattr(module, n, None) for n in names) if isinstance(t, type))
            if types and isinstance(err, types):
                return service
        if isinstance(err, ConnectionError | TimeoutError):  # a socket refused, reset or timed out
            return "backing service"
    return None


#: A write refused for want of space: the disk (ENOSPC) or the user's quota (EDQUOT).
_FULL = {errno.ENOSPC, errno.EDQUOT}


def storage_full(exc: BaseException) -> bool:
    """Return whether ``exc`` (or what caused it) is a write refused because a disk or quota is full."""
    for err in _chain(exc):
        if isinstance(err, OSError) and err.errno in _FULL:
            return True
        # shutil.copytree collects its failures into one shutil.Error of (src, dst, "why")
        # strings, the errno only in the text.
        if isinstance(err, shutil.Error) and err.args and isinstance(err.args[0], list):
            marks = tuple(f"[Errno {n}]" for n in _FULL)
            if any(isinstance(e, tuple) and len(e) == 3 and str(e[2]).startswith(marks) for e in err.args[0]):
                return True
    return False
