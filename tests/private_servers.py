"""Private PostgreSQL and Redis servers that a test may stop and start (no tests here).

The machine's shared servers (PostgreSQL on 5432, Redis on 6379) serve other people's tests
and are never restarted; the fault tests restart these instead. PostgreSQL is a throwaway
cluster made with ``initdb`` (as the ``postgres`` user when the tests run as root: PostgreSQL
refuses to run as root) on a free port, Redis a ``redis-server`` without persistence, each
in its own temporary directory, removed by ``close()``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from jobs_support import free_port

__all__ = ["PrivatePostgres", "PrivateRedis", "postgres_bin"]


def postgres_bin() -> Path | None:
    """Return the directory of ``initdb``/``pg_ctl`` (Debian keeps them off PATH), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if found:
        return Path(found[-1]).parent
    which = shutil.which("pg_ctl")
    return Path(which).parent if which else None


class PrivatePostgres:
    """A PostgreSQL cluster of its own on 127.0.0.1:<port>, trust auth, database ``kiln``."""

    def __init__(self) -> None:
        bin_dir = postgres_bin()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL's initdb/pg_ctl are not installed (apt install postgresql)")
        self.bin = bin_dir
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kiln-pg-"))
        self.data = self.dir / "data"
        # PostgreSQL will not run as root: then everything runs as the postgres user.
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        self.start()
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "kiln")
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/kiln"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self.as_user, str(self.bin / tool), *args], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.dir / "log"), "-w", "start")

    def stop(self) -> None:
        """Stop the server the way a crash or a failover does: connections are cut."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateRedis:
    """A redis-server of its own on 127.0.0.1:<port>, without persistence (a restart loses everything)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGKILL: a crash, its queued messages gone with it."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def close(self) -> None:
        self.stop()
