"""A job for an engine no worker serves: refused at submission, or (when the spec says to wait) failed after the wait.

The real service: `kiln api` and one `kiln worker --engine onnxruntime` on the real Redis and
PostgreSQL. Nothing serves openvino here, so a job that needs it must never sit "running"
forever.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from jobs_support import Proc, free_port, migrated_pg, redis_url, service_env, submit, wait_http, wait_job, wait_workers

WAIT = 2.0  # KILN_WORKER_WAIT_SECONDS for this service: short, so the test sees the timeout


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("engine-wait")
    port = free_port()
    env: dict[str, Any] = {
        "database_url": migrated_pg(),
        "broker_url": redis_url(12),
        "repository": str(root / "repo"),
        "artifact_store": str(root / "store"),
        "step_heartbeat_interval": 0.5,
        "worker_wait_seconds": WAIT,
    }
    worker = Proc(["worker", "--engine", "onnxruntime"], service_env(cache_dir=root / "w", **env), root / "worker.log")
    api = Proc(
        ["api", "--port", str(port), "--no-access-log"], service_env(cache_dir=root / "a", **env), root / "api.log"
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/healthz", proc=api)
        wait_workers(base, {"onnxruntime"}, procs=[worker])
        yield base
    finally:
        api.stop()
        worker.stop()


def _job_count(base: str) -> int:
    return int(httpx.get(f"{base}/jobs", params={"limit": 1}).json()["count"])


def test_a_job_for_an_engine_without_a_worker_is_refused_at_submit(service: str, cnn_onnx: Path) -> None:
    before = _job_count(service)
    r = submit(service, cnn_onnx, {"targets": ["onnxruntime", "openvino"], "benchmark": False})
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["code"] == "ENGINE_UNAVAILABLE" and "wait_for_workers" in body["hint"]
    assert body["details"] == {"engines": ["openvino"], "queues": ["kiln.openvino"]}
    assert _job_count(service) == before  # nothing recorded, nothing queued
    # The engines that are served still take jobs.
    assert submit(service, cnn_onnx, {"targets": ["onnxruntime"], "benchmark": False}).status_code == 202


def test_a_job_asked_to_wait_fails_its_unserved_steps_after_the_wait(service: str, cnn_onnx: Path) -> None:
    spec = {"targets": ["onnxruntime", "openvino"], "benchmark": False, "wait_for_workers": True}
    r = submit(service, cnn_onnx, spec)
    assert r.status_code == 202, r.text
    job = wait_job(service, r.json()["id"], timeout=90)
    assert job["status"] == "failed"
    assert job["targets"]["onnxruntime"]["status"] == "succeeded"  # the served target is not held back
    openvino = job["targets"]["openvino"]
    assert openvino["status"] == "failed" and openvino["error"]["code"] == "ENGINE_UNAVAILABLE"
    details = openvino["error"]["details"]
    assert details["engine"] == "openvino" and details["queue"] == "kiln.openvino"
    assert details["waited_seconds"] == WAIT
    assert "KILN_WORKER_WAIT_SECONDS" in openvino["error"]["hint"]
    steps = {s["id"]: s for s in job["steps"]}
    unserved = [s for s in steps.values() if s["engine"] == "openvino"]
    assert unserved and all(s["status"] in ("failed", "skipped") for s in unserved)
    assert any(s["error"]["code"] == "ENGINE_UNAVAILABLE" for s in unserved)


def test_a_fallback_is_a_warning_on_the_job(service: str, cnn_onnx: Path) -> None:
    # int8 without calibration data: calibrated on generated samples, which the job says.
    r = submit(service, cnn_onnx, {"targets": ["onnxruntime"], "precision": "int8", "benchmark": False})
    assert r.status_code == 202, r.text
    job = wait_job(service, r.json()["id"], timeout=120)
    assert job["status"] == "succeeded", job
    warnings = job["targets"]["onnxruntime"]["warnings"]
    assert len(warnings) == 1 and "generated samples" in warnings[0]
    export = next(s for s in job["steps"] if s["id"] == "export:onnxruntime")
    assert export["report"]["warnings"] == warnings
