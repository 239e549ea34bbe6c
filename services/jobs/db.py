"""Engines and sessions for the job store: one engine per database URL and process.

SQLite (the embedded default) is shared by the API, the worker and its pool processes, so
it runs in WAL mode with a busy timeout, and write transactions start with ``BEGIN
IMMEDIATE``: a deferred transaction that reads first and writes later can fail at once with
"database is locked" when another process writes in between, whereas an immediate one
waits its turn. PostgreSQL needs none of this.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine, event

if TYPE_CHECKING:
    from services.settings import Settings

__all__ = ["IMMEDIATE", "database_url", "get_engine", "normalize_url"]

#: Execution option marking a connection whose transaction must take SQLite's write lock first.
IMMEDIATE = "kiln_sqlite_immediate"

_ENGINES: dict[tuple[str, int], Engine] = {}
_LOCK = threading.Lock()


def normalize_url(url: str) -> str:
    """Return ``url`` with the psycopg 3 driver named for PostgreSQL (SQLAlchemy defaults to psycopg2)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def database_url(settings: Settings) -> str:
    """Return the job store URL: the configured one, else SQLite in the data dir (not the cache: pruning or
    wiping the cache must not lose the jobs' history)."""
    if settings.database_url:
        return normalize_url(settings.database_url)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(settings.data_dir / 'kiln.db').resolve()}"


def _sqlite_engine(url: str) -> Engine:
    # Pooled: opening a connection and setting its pragmas costs ~1 ms, more than the reads
    # the API serves. A pooled connection holds no transaction between uses (the pool
    # rolls back on return), so it pins no WAL snapshot.
    engine = create_engine(
        url, pool_size=4, max_overflow=16, pool_recycle=600, connect_args={"timeout": 30, "check_same_thread": False}
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # let SQLAlchemy's "begin" hook below emit BEGIN
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        immediate = conn.get_execution_options().get(IMMEDIATE)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def get_engine(url: str) -> Engine:
    """Return this process's engine for ``url`` (a forked child gets its own, never its parent's pool)."""
    url = normalize_url(url)
    key = (url, os.getpid())
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            if url.startswith("sqlite"):
                engine = _sqlite_engine(url)
            else:
                # No pre-ping: it costs a round trip per checkout, on every request. A
                # connection broken by a server restart fails once; SQLAlchemy then sees the
                # disconnect and refreshes the whole pool. Recycling bounds idle connections.
                engine = create_engine(url, pool_size=10, max_overflow=20, pool_recycle=600)
            _ENGINES[key] = engine
        return engine
