"""An upload cut off by an API crash leaves no temporary file behind once the API is back, and
a starting API process never touches the scratch files of one that is still running."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

from jobs_support import Proc, free_port, redis_url, service_env, wait_http

from api.scratch import ApiScratch

BOUNDARY = "kilnboundary"


def _start_api(root: Path, port: int, n: int) -> Proc:
    env = service_env(cache_dir=root / "cache", broker_url=redis_url(14), repository=str(root / "repo"))
    proc = Proc(["api", "--port", str(port), "--no-access-log"], env, root / f"api-{n}.log")
    wait_http(f"http://127.0.0.1:{port}/healthz", proc=proc)
    return proc


def _half_sent_upload(port: int, sent_bytes: int) -> socket.socket:
    """Open POST /compile declaring a 1 GiB model and send only ``sent_bytes`` of it."""
    head = (
        f"--{BOUNDARY}\r\n"
        'Content-Disposition: form-data; name="spec"\r\n\r\n{"targets": ["onnxruntime"]}\r\n'
        f"--{BOUNDARY}\r\n"
        'Content-Disposition: form-data; name="model"; filename="big.onnx"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    declared = len(head) + 2**30
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        (
            "POST /compile HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # an API without auth answers loopback names only
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {declared}\r\n\r\n"
        ).encode()
        + head
    )
    chunk = b"\0" * (1 << 20)
    for _ in range(sent_bytes // len(chunk)):
        sock.sendall(chunk)
    return sock


def _upload_files(cache: Path) -> list[Path]:
    return [p for p in (cache / "api").glob("run-*/uploads/**/*") if p.is_file()]


def test_an_upload_cut_off_by_an_api_crash_is_removed_when_the_api_starts_again(tmp_path: Path) -> None:
    port = free_port()
    api = _start_api(tmp_path, port, 1)
    sock = _half_sent_upload(port, 8 << 20)
    try:
        deadline = time.monotonic() + 30
        while not any(p.stat().st_size >= 4 << 20 for p in _upload_files(tmp_path / "cache")):
            assert time.monotonic() < deadline, "the upload never reached the disk"
            time.sleep(0.1)
        api.kill_group(signal.SIGKILL)  # the crash: no cleanup code runs
        api.popen.wait(10)
        left = _upload_files(tmp_path / "cache")
        assert left and sum(p.stat().st_size for p in left) >= 4 << 20  # the half upload stayed behind
    finally:
        sock.close()
        api.stop()

    again = _start_api(tmp_path, port, 2)
    try:
        assert _upload_files(tmp_path / "cache") == []
        runs = [p for p in (tmp_path / "cache" / "api").iterdir() if p.is_dir()]
        assert len(runs) == 1  # only the running process's own directory
        assert "did not stop cleanly" in again.tail()
    finally:
        again.stop()
    assert list((tmp_path / "cache" / "api").iterdir()) == []  # a clean stop removes its own


def test_a_starting_process_leaves_a_live_processs_scratch_alone(tmp_path: Path) -> None:
    live = ApiScratch(tmp_path)
    (live.dir / "uploads").mkdir()
    (live.dir / "uploads" / "part").write_bytes(b"x" * 100)
    dead_dir = tmp_path / "run-deadbeef0000"
    (dead_dir / "uploads").mkdir(parents=True)
    (tmp_path / "run-deadbeef0000.lock").touch()  # its owner died: nobody holds the lock
    (tmp_path / "uploads").mkdir()  # the layout before per-process scratch
    second = ApiScratch(tmp_path)
    assert sorted(second.removed) == ["run-deadbeef0000", "uploads"]
    assert (live.dir / "uploads" / "part").read_bytes() == b"x" * 100
    assert not dead_dir.exists() and not (tmp_path / "uploads").exists()
    second.close()
    live.close()
    assert list(tmp_path.iterdir()) == []
