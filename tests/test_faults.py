"""Faults in the backing services while a job runs: the job finishes, or fails with a code;
nothing is half-published; no job is left stuck.

Real parts throughout: a real worker process, the API (in-process, so the test can hold a
step at a gate), a private PostgreSQL cluster and a private Redis that the tests restart
(never the machine's shared ones), a real SeaweedFS S3 server killed mid-publish, and a
real filesystem too small for the artifact (a tmpfs; mounting one needs root).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from jobs_support import Proc, gated_registry, service_env
from private_servers import PrivatePostgres, PrivateRedis, postgres_bin
from storage_servers import S3Server, start_seaweedfs

from api.app import create_app
from services.jobs.migrate import upgrade
from services.settings import Settings
from workers.app import create_celery_app

SPEC = '{"targets": ["onnxruntime"], "benchmark": false}'
FINAL = ("succeeded", "failed", "cancelled")
OPEN_STEPS = ("pending", "queued", "running")

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL's initdb/pg_ctl are not installed")


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[PrivatePostgres, PrivateRedis]]:
    pg = PrivatePostgres()
    redis = PrivateRedis()
    try:
        upgrade(pg.url)
        yield pg, redis
    finally:
        redis.close()
        pg.close()


class Service:
    """One onnxruntime worker process and the API in this process, on the private servers."""

    def __init__(self, root: Path, servers: tuple[PrivatePostgres, PrivateRedis], **env: Any) -> None:
        pg, redis = servers
        self.root = root
        self.gate = root / "gate"
        self.env: dict[str, Any] = {
            "database_url": pg.url,
            "broker_url": redis.url,
            "repository": str(root / "repo"),
            "artifact_store": str(root / "store"),
            "step_heartbeat_interval": 0.5,
            "step_stale_after": 4,
            **env,
        }
        self.worker = Proc(
            ["worker", "--engine", "onnxruntime", "--concurrency", "2"],
            service_env(cache_dir=root / "worker-cache", test_gate=self.gate, **self.env),
            root / "worker.log",
        )
        settings = Settings(cache_dir=root / "api-cache", **self.env)
        self.client = TestClient(create_app(settings, create_celery_app(settings), registry=gated_registry()))
        self.client.__enter__()
        deadline = time.monotonic() + 90
        while not any(e["workers"] for e in self.client.get("/engines").json()["engines"]):
            assert self.worker.alive(), self.worker.tail()
            assert time.monotonic() < deadline, "the worker did not come up"
            time.sleep(0.3)

    def submit(self, cnn_onnx: Path) -> str:
        files = {"model": ("cnn.onnx", cnn_onnx.read_bytes()), "spec": (None, SPEC)}
        r = self.client.post("/compile", files=files, params={"cache": "false"})
        assert r.status_code == 202, r.text
        return str(r.json()["id"])

    def wait_for(self, job_id: str, mark: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not list((self.gate / job_id).glob(mark)):
            assert time.monotonic() < deadline, f"{mark} never came:\n{self.worker.tail()}"
            assert self.worker.alive(), self.worker.tail()
            time.sleep(0.1)

    def release(self, job_id: str, name: str = "release") -> None:
        (self.gate / job_id).mkdir(parents=True, exist_ok=True)
        (self.gate / job_id / name).touch()

    def final(self, job_id: str, timeout: float = 150) -> dict[str, Any]:
        """Wait until the job is final and none of its steps is open; tolerate 503 during outages."""
        deadline = time.monotonic() + timeout
        job: dict[str, Any] = {}
        while time.monotonic() < deadline:
            r = self.client.get(f"/jobs/{job_id}")
            if r.status_code == 200:
                job = r.json()
                if job["status"] in FINAL and not any(s["status"] in OPEN_STEPS for s in job["steps"]):
                    return job
            else:
                assert r.status_code == 503 and r.json()["code"] == "SERVICE_UNAVAILABLE", r.text
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} is stuck: {job}\n{self.worker.tail()}")

    def close(self) -> None:
        self.client.__exit__(None, None, None)
        self.worker.stop()


@pytest.fixture
def service(tmp_path: Path, servers: tuple[PrivatePostgres, PrivateRedis]) -> Iterator[Service]:
    svc = Service(tmp_path, servers)
    try:
        yield svc
    finally:
        svc.close()


def _versions(repo: Path) -> list[str]:
    """Every entry under the repository's model directories (Triton's root), hidden ones included."""
    return sorted(str(p.relative_to(repo)) for p in repo.glob("triton/*/*")) if repo.exists() else []


def _assert_clean_outcome(job: dict[str, Any]) -> None:
    """Finished, or failed with a code on every failed step; no step left open."""
    assert job["status"] in FINAL
    assert not [s["id"] for s in job["steps"] if s["status"] in OPEN_STEPS]
    for step in job["steps"]:
        if step["status"] == "failed":
            assert step["error"]["code"] not in ("", "INTERNAL"), step


def test_redis_restarted_mid_job_loses_no_job(service: Service, servers: Any, cnn_onnx: Path) -> None:
    _, redis = servers
    job_id = service.submit(cnn_onnx)
    service.wait_for(job_id, "started-*")
    redis.stop()  # a crash: every queued and unacknowledged message is gone
    time.sleep(1)
    redis.start()
    service.release(job_id)
    job = service.final(job_id)
    _assert_clean_outcome(job)
    assert job["status"] == "succeeded", job
    assert job["targets"]["onnxruntime"]["published"]["version"] == 1
    assert _versions(service.root / "repo") == ["triton/cnn/1", "triton/cnn/config.pbtxt", "triton/cnn/kiln-model.json"]


def test_postgresql_restarted_mid_job_loses_no_job(service: Service, servers: Any, cnn_onnx: Path) -> None:
    pg, _ = servers
    job_id = service.submit(cnn_onnx)
    service.wait_for(job_id, "started-*")
    pg.stop()  # immediate: connections cut, like a crash or a failover
    r = service.client.get(f"/jobs/{job_id}")
    assert r.status_code == 503 and r.json()["code"] == "SERVICE_UNAVAILABLE"
    service.release(job_id)  # the step finishes while the database is down
    time.sleep(3)
    pg.start()
    job = service.final(job_id)
    _assert_clean_outcome(job)
    assert job["status"] == "succeeded", job
    assert job["targets"]["onnxruntime"]["published"]["version"] == 1
    assert _versions(service.root / "repo") == ["triton/cnn/1", "triton/cnn/config.pbtxt", "triton/cnn/kiln-model.json"]


class SmallDisk:
    """A real 1 MiB tmpfs that ``fill()`` fills to its last page (mounting one needs root)."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount

    def fill(self) -> None:
        free = os.statvfs(self.mount)
        # Everything but one page: a small file still fits, a model does not.
        (self.mount / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 4096))

    def free(self) -> None:
        (self.mount / "filler").unlink()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield SmallDisk(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("full", ["repository", "artifact_store"])
def test_a_disk_that_fills_up_mid_job_fails_it_with_storage_full_and_publishes_nothing(
    tmp_path: Path, servers: Any, small_disk: SmallDisk, cnn_onnx: Path, transformer_onnx: Path, full: str
) -> None:
    location = small_disk.mount / full
    svc = Service(tmp_path, servers, **{full: str(location)})
    try:
        job_id = svc.submit(cnn_onnx)
        svc.wait_for(job_id, "started-*")  # the export is running; the disk fills up meanwhile
        small_disk.fill()
        svc.release(job_id)
        job = svc.final(job_id)
        _assert_clean_outcome(job)
        assert job["status"] == "failed"
        codes = {s["error"]["code"] for s in job["steps"] if s["status"] == "failed"}
        assert codes == {"STORAGE_FULL"}, [s["error"] for s in job["steps"] if s["error"]]
        assert job["targets"]["onnxruntime"]["error"]["code"] == "STORAGE_FULL"
        # Nothing half-written is left: no version, no hidden temporary copy.
        leftovers = [str(p.relative_to(location)) for p in location.rglob("*")] if location.exists() else []
        assert [p for p in leftovers if ".tmp" in p or p.split("/")[-1].isdigit()] == [], leftovers
        if full == "artifact_store":  # an upload the store cannot take is refused, not a 500
            files = {"model": ("other.onnx", transformer_onnx.read_bytes()), "spec": (None, SPEC)}
            r = svc.client.post("/compile", files=files)
            assert r.status_code == 507 and r.json()["code"] == "STORAGE_FULL", r.text
        # Space freed, the same job goes through.
        small_disk.free()
        again = svc.final(svc_submit_released(svc, cnn_onnx))
        assert again["status"] == "succeeded", [(s["id"], s["error"]) for s in again["steps"] if s.get("error")]
    finally:
        svc.close()


def svc_submit_released(svc: Service, cnn_onnx: Path) -> str:
    job_id = svc.submit(cnn_onnx)
    svc.release(job_id)
    return job_id


@pytest.fixture
def s3() -> Iterator[S3Server]:
    server = start_seaweedfs("kiln-faults")
    try:
        yield server
    finally:
        server.stop()


def test_s3_down_mid_publish_fails_with_a_code_and_the_half_version_never_shows(
    tmp_path: Path, servers: Any, s3: S3Server, cnn_onnx: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import services.graph.planner as planner

    monkeypatch.setattr(planner, "PUBLISH_ENTRY", "jobs_support:gated_s3_publish")
    s3_env = {
        "repository": f"s3://{s3.bucket}/repo",
        "s3_endpoint_url": s3.endpoint_url,
        "s3_access_key_id": s3.access_key_id,
        "s3_secret_access_key": s3.secret_access_key,
    }
    svc = Service(tmp_path, servers, **s3_env)
    try:
        job_id = svc.submit(cnn_onnx)
        svc.release(job_id)
        svc.wait_for(job_id, "mid-publish")
        s3.crash()  # the model is uploaded, its manifest (the commit record) is not
        svc.release(job_id, "release-publish")
        job = svc.final(job_id)
        _assert_clean_outcome(job)
        assert job["status"] == "failed", job
        publish = next(s for s in job["steps"] if s["id"] == "publish:onnxruntime")
        assert publish["error"]["code"] == "SERVICE_UNAVAILABLE", publish
        s3.restart()
        repo = svc.client.get("/repository").json()
        assert [m for m in repo["models"] if m["versions"]] == []  # the half version is invisible
        # S3 back: the next job publishes version 1 with exactly its own files.
        again_id = svc_submit_released(svc, cnn_onnx)
        svc.release(again_id, "release-publish")
        again = svc.final(again_id, timeout=200)
        assert again["status"] == "succeeded", [(s["id"], s["error"]) for s in again["steps"] if s.get("error")]
        assert again["targets"]["onnxruntime"]["published"]["version"] == 1
    finally:
        svc.close()
