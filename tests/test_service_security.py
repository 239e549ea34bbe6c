"""Safe defaults against the real processes, over HTTP: `kiln serve` refuses cross-origin changes,
and `kiln api` + a worker on the real Redis and PostgreSQL keep tenants apart.

Embedded: `kiln serve` with auth off (a laptop): a POST /compile from another site's page
(Origin, Sec-Fetch-Site) is FORBIDDEN and records nothing; a DNS-rebound Host is refused.
Distributed: auth on, tokens of two tenants made with `kiln token create --tenant`, and the
deployment's admin token from KILN_ADMIN_TOKEN: tenant B compiles a model for real; tenant
A's read token cannot see B's job, log, events, artifact or published model, and A's write
token cannot cancel B's job or publish under B's model name.
"""

from __future__ import annotations

import io
import json
import secrets
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from jobs_support import (
    KILN_CMD,
    Proc,
    create_pg_database,
    free_port,
    redis_url,
    service_env,
    submit,
    wait_http,
)

from services.jobs.migrate import upgrade

ATTACK = {"Origin": "http://attacker.example", "Sec-Fetch-Site": "cross-site"}
SPEC: dict[str, Any] = {
    "targets": ["onnxruntime"],
    "benchmark": {"iterations": 3, "warmup": 1},
    "validation": {"samples": 2},
}


# --- kiln serve, auth off ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("serve-open")
    port = free_port()
    proc = Proc(
        ["serve", "--port", str(port), "--repo", str(root / "repo")],
        service_env(cache_dir=root / "cache"),
        root / "serve.log",
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/healthz", timeout=120, proc=proc)
        yield base
    finally:
        proc.stop()


def test_a_cross_origin_post_to_kiln_serve_is_refused_and_records_nothing(served: str, cnn_onnx: Path) -> None:
    before = httpx.get(f"{served}/jobs").json()["count"]
    spec = {**SPEC, "wait_for_workers": True}
    for headers in (
        ATTACK,
        {"Origin": "http://attacker.example"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Origin": "null"},
    ):
        r = submit(served, cnn_onnx, spec, headers=headers)
        assert r.status_code == 403, (headers, r.text)
        body = r.json()
        assert body["code"] == "FORBIDDEN" and "hint" in body and "Traceback" not in r.text
    r = httpx.delete(f"{served}/jobs/{'0' * 32}", headers=ATTACK)
    assert r.status_code == 403 and r.json()["code"] == "FORBIDDEN"
    assert httpx.get(f"{served}/jobs").json()["count"] == before  # nothing was accepted
    # The same request from a pipeline (no Origin) or from the dashboard's own page goes through.
    assert submit(served, cnn_onnx, spec).status_code == 202
    own = {"Origin": served, "Sec-Fetch-Site": "same-origin"}
    assert submit(served, cnn_onnx, spec, headers=own).status_code == 202
    assert httpx.get(f"{served}/jobs").json()["count"] == before + 2


def test_kiln_serve_without_auth_answers_only_loopback_host_names(served: str) -> None:
    port = served.rsplit(":", 1)[1]
    assert httpx.get(f"http://localhost:{port}/healthz").status_code == 200
    rebound = httpx.get(f"{served}/jobs", headers={"Host": f"attacker.example:{port}"})
    assert rebound.status_code == 403 and rebound.json()["code"] == "FORBIDDEN"


# --- kiln api + worker, auth on, two tenants -------------------------------------------------------


class Tenants:
    def __init__(self, base: str, heads: dict[str, dict[str, str]], root: Path) -> None:
        self.base, self.h, self.root = base, heads, root

    def get(self, path: str, who: str, **kw: Any) -> httpx.Response:
        return httpx.get(f"{self.base}{path}", headers=self.h[who], timeout=30, **kw)

    def wait(self, job_id: str, who: str, timeout: float = 240) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        job: dict[str, Any] = {}
        while time.monotonic() < deadline:
            job = self.get(f"/jobs/{job_id}", who).json()
            if job.get("status") in ("succeeded", "failed", "cancelled"):
                return job
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} did not finish: {json.dumps(job)[:2000]}")


def _token(env: dict[str, str], name: str, scope: str, tenant: str) -> str:
    done = subprocess.run(
        [*KILN_CMD, "token", "create", name, "--scope", scope, "--tenant", tenant],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    root = tmp_path_factory.mktemp("tenants")
    db = create_pg_database("kiln_tenants")
    upgrade(db)
    admin = f"kiln_{secrets.token_hex(4)}_{secrets.token_urlsafe(32)}"
    kiln = {
        "database_url": db,
        "broker_url": redis_url(12),  # a database of its own: the end-to-end tests use 13 and 14
        "repository": str(root / "repo"),
        "artifact_store": str(root / "store"),
        "auth_enabled": "true",
        "admin_token": admin,
        "step_heartbeat_interval": 0.5,
    }
    cli_env = service_env(cache_dir=root / "cli", **kiln)
    heads = {
        who: {"Authorization": f"Bearer {_token(cli_env, who, scope, tenant)}"}
        for who, scope, tenant in (
            ("a-read", "read", "team-a"),
            ("a-write", "write", "team-a"),
            ("b-write", "write", "team-b"),
        )
    }
    heads["admin"] = {"Authorization": f"Bearer {admin}"}
    port = free_port()
    worker = Proc(
        ["worker", "--engine", "onnxruntime", "--concurrency", "2"],
        service_env(cache_dir=root / "w", **kiln),
        root / "worker.log",
    )
    api = Proc(
        ["api", "--port", str(port), "--no-access-log"], service_env(cache_dir=root / "api", **kiln), root / "api.log"
    )
    t = Tenants(f"http://127.0.0.1:{port}", heads, root)
    try:
        wait_http(f"{t.base}/healthz", proc=api)
        deadline = time.monotonic() + 120
        while not any(e["workers"] for e in t.get("/engines", "admin").json()["engines"] if e["name"] == "onnxruntime"):
            assert time.monotonic() < deadline and worker.alive(), worker.tail()
            time.sleep(0.3)
        yield t
    finally:
        api.stop()
        worker.stop()


def test_a_read_token_of_one_tenant_sees_nothing_of_another_tenants_job(tenants: Tenants, cnn_onnx: Path) -> None:
    t = tenants
    r = submit(t.base, cnn_onnx, {**SPEC, "name": "b-model"}, headers=t.h["b-write"])
    assert r.status_code == 202, r.text
    b_id = r.json()["id"]
    job = t.wait(b_id, "b-write")
    assert job["status"] == "succeeded" and job["tenant"] == "team-b", json.dumps(job)[:2000]
    # B itself reads all of it: the job, its log and events, the artifact, the published model.
    assert "step_finished" in t.get(f"/jobs/{b_id}/logs", "b-write").text
    tar = t.get(f"/jobs/{b_id}/artifacts/onnxruntime", "b-write")
    assert tar.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(tar.content)) as tf:
        assert any(n.endswith("/model.onnx") for n in tf.getnames())
    assert "b-model" in {m["name"] for m in t.get("/repository", "b-write").json()["models"]}
    # A's tokens get the answer for a job that does not exist, whatever they ask.
    for who in ("a-read", "a-write"):
        for path in (
            f"/jobs/{b_id}",
            f"/jobs/{b_id}/logs",
            f"/jobs/{b_id}/events",
            f"/jobs/{b_id}/artifacts/onnxruntime",
        ):
            r = t.get(path, who)
            assert r.status_code == 404 and r.json() == {
                "code": "NOT_FOUND",
                "message": f"no job {b_id}",
                "hint": "List jobs with GET /jobs.",
            }, (who, path, r.text)
        assert b_id not in {j["id"] for j in t.get("/jobs", who, params={"limit": 500}).json()["data"]}
        assert "b-model" not in {m["name"] for m in t.get("/repository", who).json()["models"]}
        assert t.get("/jobs", who, params={"tenant": "team-b"}).json()["count"] == 0
    # The admin token sees every tenant's.
    assert t.get(f"/jobs/{b_id}", "admin").json()["tenant"] == "team-b"
    assert "b-model" in {m["name"] for m in t.get("/repository", "admin").json()["models"]}


def test_a_write_token_of_one_tenant_cannot_cancel_or_publish_for_another(tenants: Tenants, cnn_onnx: Path) -> None:
    t = tenants
    # B's job waits for an engine no worker serves here, so that it is still open to cancel.
    waiting = {**SPEC, "targets": ["openvino"], "name": "b-waiting", "wait_for_workers": True}
    b_id = submit(t.base, cnn_onnx, waiting, headers=t.h["b-write"]).json()["id"]
    assert httpx.delete(f"{t.base}/jobs/{b_id}", headers=t.h["a-write"]).status_code == 404
    r = httpx.post(f"{t.base}/jobs/{b_id}/resubmit", headers=t.h["a-write"])
    assert r.status_code == 404 and r.json()["code"] == "NOT_FOUND"
    assert t.get(f"/jobs/{b_id}", "b-write").json()["status"] in ("queued", "running")  # untouched
    # B's model name (published by the test above, or claimed by this job) is not A's to publish under.
    for name in ("b-model", "b-waiting"):
        r = submit(t.base, cnn_onnx, {**SPEC, "name": name}, headers=t.h["a-write"])
        assert r.status_code == 403 and r.json()["code"] == "FORBIDDEN" and r.json()["details"]["names"] == [name]
    a_id = submit(t.base, cnn_onnx, {**SPEC, "name": "a-model"}, headers=t.h["a-write"]).json()["id"]
    r = httpx.post(f"{t.base}/jobs/{a_id}/resubmit", headers=t.h["a-write"], json={"spec": {**SPEC, "name": "b-model"}})
    assert r.status_code == 403 and r.json()["code"] == "FORBIDDEN"
    assert t.wait(a_id, "a-write")["status"] == "succeeded"
    # Nothing of A's reached B's names in the repository: b-model's versions are all B's jobs'.
    models = {m["name"]: m for m in t.get("/repository", "admin").json()["models"]}
    b_jobs = {j["id"] for j in t.get("/jobs", "b-write", params={"limit": 500}).json()["data"]}
    assert {v["job_id"] for v in models["b-model"]["versions"]} <= b_jobs
    assert "a-model" in models and "a-model" not in {
        m["name"] for m in t.get("/repository", "b-write").json()["models"]
    }
    # B, and the admin, may cancel B's job.
    assert httpx.delete(f"{t.base}/jobs/{b_id}", headers=t.h["b-write"]).json()["status"] == "cancelled"
