"""End to end, as a pipeline uses the service: real API and worker processes, HTTP all the way.

Distributed: `kiln api` plus one `kiln worker` per engine (onnxruntime, openvino) on the real
Redis and PostgreSQL. Embedded: `kiln serve` alone (SQLite, local directories, the
filesystem broker). Both submit over HTTP, follow the SSE stream and download artifacts;
the distributed one also survives an API restart and a worker SIGKILLed mid-conversion.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from jobs_support import (
    Proc,
    free_port,
    gated_registry,
    migrated_pg,
    read_sse,
    redis_url,
    sandboxed_host_pid,
    service_env,
    submit,
    wait_http,
    wait_job,
    wait_workers,
)

SPEC: dict[str, Any] = {
    "targets": ["onnxruntime", "openvino"],
    "benchmark": {"iterations": 5, "warmup": 1},
    "validation": {"samples": 4},
}


@dataclasses.dataclass
class Cluster:
    base: str
    port: int
    root: Path
    env: dict[str, Any]
    api: Proc
    workers: dict[str, Proc]

    def start_api(self) -> Proc:
        self.api = Proc(
            ["api", "--port", str(self.port), "--no-access-log"],
            service_env(cache_dir=self.root / "api-cache", **self.env),
            self.root / "api.log",
        )
        wait_http(f"{self.base}/healthz", proc=self.api)
        return self.api

    def start_worker(self, engine: str) -> Proc:
        n = len(list(self.root.glob(f"worker-{engine}-*.log")))
        proc = Proc(
            ["worker", "--engine", engine, "--concurrency", "2"],
            service_env(cache_dir=self.root / f"cache-{engine}-{n}", **self.env),
            self.root / f"worker-{engine}-{n}.log",
        )
        self.workers[engine] = proc
        return proc


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    port = free_port()
    env = {
        "database_url": migrated_pg(),
        "broker_url": redis_url(),
        "repository": str(root / "repo"),
        "artifact_store": str(root / "store"),
        "step_heartbeat_interval": 0.5,
        "step_stale_after": 4,
        "test_gate": str(root / "gate"),
    }
    c = Cluster(base=f"http://127.0.0.1:{port}", port=port, root=root, env=env, api=None, workers={})  # type: ignore[arg-type]
    try:
        for engine in ("onnxruntime", "openvino"):
            c.start_worker(engine)
        c.start_api()
        wait_workers(c.base, {"onnxruntime", "openvino"}, procs=list(c.workers.values()))
        yield c
    finally:
        for p in [c.api, *c.workers.values()]:
            if p is not None:
                p.stop()


def _untar(content: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(content)) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}  # type: ignore[union-attr]


def _check_finished_job(base: str, job_id: str, events: list[dict[str, Any]]) -> dict[str, Any]:
    types = [e["type"] for e in events]
    assert types[0] == "submitted" and types[1] == "planned" and types[-1] == "finished"
    started = {e["step"]: e for e in events if e["type"] == "step_started"}
    assert {"reference", "export:onnxruntime", "export:openvino", "publish:openvino"} <= set(started)
    job = httpx.get(f"{base}/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job
    for target in ("onnxruntime", "openvino"):
        t = job["targets"][target]
        assert t["status"] == "succeeded"
        assert t["parity"]["passed"] is True and t["parity"]["outputs"][0]["cosine"] > 0.999
        assert t["benchmark"] and t["benchmark"][0]["p50_ms"] > 0
        assert t["published"]["version"] >= 1
    steps = {s["id"]: s for s in job["steps"]}
    assert steps["optimize/onnx-to-openvino-ir"]["queue"] == "kiln.openvino"
    assert steps["export:onnxruntime"]["queue"] == "kiln.onnxruntime"
    assert all(s["finished_at"] for s in steps.values())
    # Routes are planned only through engines a live worker serves (issue 27): a step on an engine
    # no worker serves would wait forever. Every planned step ran but fallbacks, skipped as not needed.
    engines = {e["name"]: e for e in httpx.get(f"{base}/engines").json()["engines"]}
    assert all(engines[s["engine"]]["workers"] for s in steps.values()), {s["engine"] for s in steps.values()}
    unused = {sid for sid, s in steps.items() if (s["report"] or {}).get("not_needed")}
    assert unused == {s["id"] for s in job["plan"]["steps"] if s["fallback"]}
    assert all(s["seconds"] is not None for sid, s in steps.items() if sid not in unused)
    tars = {t: _untar(httpx.get(f"{base}{job['targets'][t]['download_url']}").content) for t in job["targets"]}
    assert any(n.endswith("/model.onnx") for n in tars["onnxruntime"])
    assert any(n.endswith("/model.xml") for n in tars["openvino"]) and any(
        n.endswith("/model.bin") for n in tars["openvino"]
    )
    return job


def test_a_pipeline_submits_follows_and_downloads_across_two_engine_workers(cluster: Cluster, cnn_onnx: Path) -> None:
    r = submit(cluster.base, cnn_onnx, SPEC)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert r.headers["location"] == f"/jobs/{job_id}"
    events = read_sse(cluster.base, job_id)
    job = _check_finished_job(cluster.base, job_id, events)
    # The steps ran on both engines' workers: conversion hops crossed queues.
    workers = {s["engine"]: s["worker"] for s in job["steps"] if s["worker"]}
    assert workers["openvino"] != workers["onnxruntime"]
    # No worker here serves kiln.tensorflow: openvino's fallback through onnx2tf is not planned.
    assert "kiln.tensorflow" not in {s["queue"] for s in job["steps"]}
    assert any(e["type"] == "progress" for e in events)
    repo = httpx.get(f"{cluster.base}/repository").json()
    names = {m["name"]: m for m in repo["models"]}
    assert names["cnn-openvino"]["root"] == "triton"
    assert names["cnn-openvino"]["target"] == "openvino" and names["cnn-onnxruntime"]["versions"][0]["job_id"] == job_id
    engines = {e["name"]: e for e in httpx.get(f"{cluster.base}/engines").json()["engines"]}
    assert engines["openvino"]["workers"] == 1 and engines["openvino"]["versions"]["openvino"]
    logs = httpx.get(f"{cluster.base}/jobs/{job_id}/logs").text
    assert "step_finished" in logs and "export:openvino" in logs


def test_an_identical_resubmission_completes_from_the_cache(cluster: Cluster, cnn_onnx: Path) -> None:
    # The first submission of its own (the cluster's earlier tests may not have run): its versions stand.
    first = wait_job(cluster.base, submit(cluster.base, cnn_onnx, SPEC).json()["id"])
    assert first["status"] == "succeeded", first
    versions = {t: first["targets"][t]["published"]["version"] for t in first["targets"]}
    job = wait_job(cluster.base, submit(cluster.base, cnn_onnx, SPEC).json()["id"])
    assert job["status"] == "succeeded"
    assert job["cached"] is True, [(s["id"], s["cached"]) for s in job["steps"]]
    ran = [s for s in job["steps"] if not (s["report"] or {}).get("not_needed")]  # fallback routes left unused
    assert ran and all(s["cached"] for s in ran), [(s["id"], s["cached"]) for s in ran]
    # Nothing was published again: the versions are the first job's.
    assert {t: job["targets"][t]["published"]["version"] for t in job["targets"]} == versions


def test_a_corrupt_model_is_refused_at_submission_as_source_unreadable(
    cluster: Cluster, cnn_onnx: Path, tmp_path: Path
) -> None:
    """What vetting cannot read no loader gets (issue 31): a truncated ONNX is 400 before any job exists."""
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(cnn_onnx.read_bytes()[:300])
    before = httpx.get(f"{cluster.base}/jobs").json()["count"]
    r = submit(cluster.base, truncated, {"targets": ["onnxruntime"]})
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "SOURCE_UNREADABLE" and "truncated.onnx" in r.json()["message"]
    assert httpx.get(f"{cluster.base}/jobs").json()["count"] == before


def test_restarting_the_api_mid_job_loses_nothing(cluster: Cluster, cnn_onnx: Path) -> None:
    r = submit(cluster.base, cnn_onnx, SPEC, params={"cache": "false"})
    job_id = r.json()["id"]
    cluster.api.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{cluster.base}/healthz")
    cluster.start_api()
    events = read_sse(cluster.base, job_id)
    job = _check_finished_job(cluster.base, job_id, events)
    assert not any(s["cached"] for s in job["steps"] if s["kind"] != "publish")
    assert {t["published"]["version"] for t in job["targets"].values()} == {2}


@pytest.fixture(scope="module")
def gated(cluster: Cluster) -> Iterator[Any]:
    """The same service in-process, with the onnxruntime exporter held at a per-job gate."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from services.settings import Settings
    from workers.app import create_celery_app

    reg = gated_registry()
    env = {k: v for k, v in cluster.env.items() if k != "test_gate"}
    settings = Settings(cache_dir=cluster.root / "inproc-cache", **env)
    with TestClient(create_app(settings, create_celery_app(settings), registry=reg)) as client:
        yield client


def _submit_gated(client: Any, cnn_onnx: Path, gate_root: Path) -> tuple[str, Path, int]:
    """Submit a job and wait until its export step is running; return (job id, its gate, the step's pid)."""
    with open(cnn_onnx, "rb") as fh:
        r = client.post(
            "/compile",
            files={"model": ("gated.onnx", fh), "spec": (None, '{"targets": ["onnxruntime"], "benchmark": false}')},
            params={"cache": "false"},
        )
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    gate = gate_root / job_id
    deadline = time.monotonic() + 90
    while not list(gate.glob("started-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    started = list(gate.glob("started-*"))
    assert started, client.get(f"/jobs/{job_id}/logs").text
    return job_id, gate, sandboxed_host_pid(int(started[0].name.split("-")[1]), f"KILN_TEST_GATE={gate_root}")


def _wait_in_process(client: Any, job_id: str, watch: Proc | None = None, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled") and not any(
            s["status"] == "running" for s in job["steps"]
        ):
            return job
        if watch is not None:
            assert watch.alive(), watch.tail()
        time.sleep(0.2)
    raise AssertionError(job)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_cancelling_a_running_job_stops_its_step(cluster: Cluster, gated: Any, cnn_onnx: Path) -> None:
    job_id, gate, pid = _submit_gated(gated, cnn_onnx, Path(cluster.env["test_gate"]))
    r = gated.delete(f"/jobs/{job_id}")
    assert r.status_code == 202 and r.json()["status"] == "cancelled"
    job = _wait_in_process(gated, job_id, timeout=30)
    export = next(s for s in job["steps"] if s["id"] == "export:onnxruntime")
    assert export["status"] == "cancelled" and export["error"]["code"] == "CANCELLED"
    assert next(s for s in job["steps"] if s["id"] == "publish:onnxruntime")["status"] == "cancelled"
    assert not _pid_alive(pid)  # the converting child was killed, not left to finish
    assert not (gate / "release").exists()


def test_a_worker_sigkilled_mid_conversion_loses_no_job(cluster: Cluster, gated: Any, cnn_onnx: Path) -> None:
    job_id, gate, pid = _submit_gated(gated, cnn_onnx, Path(cluster.env["test_gate"]))
    victim = cluster.workers["onnxruntime"]
    victim.kill_group(signal.SIGKILL)  # the worker, its forkserver and the converting child
    victim.popen.wait(10)
    (gate / "release").touch()
    replacement = cluster.start_worker("onnxruntime")
    job = _wait_in_process(gated, job_id, watch=replacement)
    assert job["status"] == "succeeded", job
    export = next(s for s in job["steps"] if s["id"] == "export:onnxruntime")
    assert export["attempt"] == 2 and export["worker"] != job["steps"][0]["worker"]
    log = gated.get(f"/jobs/{job_id}/logs").text
    assert "step_requeued" in log and "stopped heartbeating" in log
    assert job["targets"]["onnxruntime"]["parity"]["passed"] is True
    assert not _pid_alive(pid)  # the first attempt's child died with its worker


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Proc, Path]]:
    root = tmp_path_factory.mktemp("embedded")
    port = free_port()
    proc = Proc(
        ["serve", "--port", str(port), "--repo", str(root / "repo")],
        service_env(cache_dir=root / "cache"),
        root / "serve.log",
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/healthz", proc=proc)
        wait_workers(base, {"onnxruntime", "openvino"}, procs=[proc])
        yield base, proc, root
    finally:
        proc.stop()


def test_the_same_flow_passes_in_the_embedded_default(embedded: tuple[str, Proc, Path], cnn_onnx: Path) -> None:
    base, _, root = embedded
    ready = httpx.get(f"{base}/readyz").json()
    checks = {"broker": "ok", "database": "ok", "storage": "ok", "workers": "ok"}  # workers: kiln serve's own
    assert ready == {"status": "ready", "checks": checks, "starting": []}
    job_id = submit(base, cnn_onnx, SPEC).json()["id"]
    _check_finished_job(base, job_id, read_sse(base, job_id))
    assert (root / "repo" / "triton" / "cnn-openvino" / "1" / "model.xml").exists()
    assert (root / "cache" / "data" / "kiln.db").exists()  # SQLite, no server, in the data dir (service_env)
    again = wait_job(base, submit(base, cnn_onnx, SPEC).json()["id"])
    ran = [s for s in again["steps"] if not (s["report"] or {}).get("not_needed")]  # fallback routes left unused
    assert again["cached"] is True and all(s["cached"] for s in ran), [(s["id"], s["cached"]) for s in ran]


def test_post_compile_refuses_a_broken_artifact_with_the_numbers(cluster: Cluster, tmp_path: Path) -> None:
    """The API plans through the saboteur (tests/verifier_support.py); the cluster's real workers run it."""
    from fastapi.testclient import TestClient
    from verifier_support import conv_net, saboteur_registry

    from api.app import create_app
    from services.settings import Settings
    from workers.app import create_celery_app

    env = {k: v for k, v in cluster.env.items() if k != "test_gate"}
    settings = Settings(cache_dir=cluster.root / "sabotage-cache", **env)
    model = conv_net(tmp_path / "net.onnx")
    with TestClient(create_app(settings, create_celery_app(settings), registry=saboteur_registry())) as client:
        with open(model, "rb") as fh:
            spec = {"targets": ["onnxruntime"], "name": "sabotage-bias", "benchmark": False}
            r = client.post("/compile", files={"model": ("net.onnx", fh), "spec": (None, json.dumps(spec))})
        assert r.status_code == 202, r.text
        job = _wait_in_process(client, r.json()["id"])
    target = job["targets"]["onnxruntime"]
    assert job["status"] == "failed" and target["error"]["code"] == "PARITY_FAILED", target
    out = target["error"]["details"]["parity"]["outputs"][0]
    assert out["snr_db"] < 1.0 and "SNR" in target["error"]["message"]
