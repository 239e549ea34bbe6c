"""kiln_client against real services: `kiln serve`, and `kiln api` + `kiln worker` on PostgreSQL and Redis.

It compiles, follows, downloads, cancels and resubmits; its typed results carry the API's
field names; retries and stream resumption are provoked by a proxy on loopback that breaks
connections the way networks do (tests/fault_proxy.py), never by mocks.
"""

from __future__ import annotations

import dataclasses
import os
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fault_proxy import FaultProxy
from jobs_support import (
    Proc,
    create_pg_database,
    free_port,
    read_sse,
    redis_url,
    service_env,
    submit,
    wait_http,
    wait_workers,
)
from kiln_client import Client, ErrorInfo, Event, JobInfo, KilnError, Plan, PlanStep, Source, Step, Target

FAST: dict[str, Any] = {
    "targets": ["onnxruntime", "openvino"],
    "benchmark": False,
    "validation": {"samples": 2},
}


@dataclasses.dataclass
class Service:
    url: str
    port: int
    root: Path
    procs: list[Proc]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """`kiln serve`: the API and an embedded worker for every engine here, SQLite, no broker server."""
    root = tmp_path_factory.mktemp("client-serve")
    port = free_port()
    proc = Proc(
        ["serve", "--port", str(port), "--repo", str(root / "repo")],
        service_env(cache_dir=root / "cache"),
        root / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", proc=proc)  # ready means its workers are up (tests/test_ready.py)
        yield Service(url, port, root, [proc])
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """`kiln api` and one `kiln worker` (onnxruntime, openvino) on the real PostgreSQL and Redis."""
    from services.jobs.migrate import upgrade

    root = tmp_path_factory.mktemp("client-cluster")
    db = create_pg_database("kiln_client")
    upgrade(db)
    env = {
        "database_url": db,
        "broker_url": redis_url(11),
        "repository": str(root / "repo"),
        "artifact_store": str(root / "store"),
        "step_heartbeat_interval": 0.5,
    }
    port = free_port()
    worker = Proc(
        ["worker", "--engine", "onnxruntime", "--engine", "openvino", "--concurrency", "2"],
        service_env(cache_dir=root / "worker-cache", **env),
        root / "worker.log",
    )
    api = Proc(
        ["api", "--port", str(port), "--no-access-log"],
        service_env(cache_dir=root / "api-cache", **env),
        root / "api.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/healthz", proc=api)
        wait_workers(url, {"onnxruntime", "openvino"}, procs=[worker])
        yield Service(url, port, root, [api, worker])
    finally:
        api.stop()
        worker.stop()


@pytest.fixture(scope="module", params=["kiln serve", "kiln api + worker"])
def service(request: pytest.FixtureRequest) -> Service:
    return request.getfixturevalue("serve" if request.param == "kiln serve" else "distributed")  # type: ignore[no-any-return]


def test_the_client_compiles_follows_and_downloads(service: Service, cnn_onnx: Path, tmp_path: Path) -> None:
    with Client(service.url) as kiln:
        job = kiln.compile(cnn_onnx, FAST, wait=False)
        assert job.status in ("queued", "running")
        events = list(job.follow())
        job.wait(timeout=120)
        # The events are the server's, in order, exactly once each, ending with `finished`.
        assert [e.id for e in events] == sorted({e.id for e in events})
        assert events[0].type == "submitted" and events[-1].type == "finished" and events[-1].data["ok"] is True
        assert {"reference", "export:onnxruntime", "export:openvino"} <= {
            e.step for e in events if e.type == "step_finished"
        }
        assert job.ok and job.status == "succeeded" and job.done
        assert set(job.targets) == {"onnxruntime", "openvino"}
        for target in job.targets.values():
            assert isinstance(target, Target) and target.ok and target.error is None
            assert target.parity is not None and target.parity["passed"] is True
            assert target.published is not None and target.published["version"] >= 1
        assert job.source.filename == "cnn.onnx" and job.source.format == "onnx" and len(job.source.sha256) == 64
        assert all(isinstance(s, Step) for s in job.steps) and job.created_at is not None
        assert job.raise_for_failure() is job
        onnx_dir = job.download("onnxruntime", tmp_path / "artifacts")
        ov_dir = job.download("openvino", tmp_path / "artifacts")
        assert onnx_dir.name == f"{job.name}-onnxruntime" and (onnx_dir / "model.onnx").stat().st_size > 0
        assert {p.name for p in ov_dir.iterdir()} >= {"model.xml", "model.bin"}
        tar = kiln.download(job.id, "openvino", tmp_path / "openvino.tar", extract=False)
        assert tar.stat().st_size > (ov_dir / "model.bin").stat().st_size
        assert not list((tmp_path / "artifacts").glob(".kiln-download-*"))  # no leftovers


def test_the_client_tunes_and_downloads_the_recommendation(service: Service, cnn_onnx: Path, tmp_path: Path) -> None:
    # The distributed worker serves onnxruntime and openvino, so it takes tune jobs too (kiln.tune).
    goals = {"targets": ["onnxruntime", "openvino"], "precisions": ["fp32"], "rounds": 5, "warmup": 1}
    with Client(service.url) as kiln:
        job = kiln.tune(cnn_onnx, goals, {"name": "client-tuned", "validation": {"samples": 4}}, timeout=300)
        files = {p.name for p in job.download("tune", tmp_path / "tuned").iterdir()}
    assert job.ok and job.kind == "tune", job.error or job.targets
    assert job.tune is not None
    timed = [c for c in job.tune["candidates"] if c["status"] == "timed"]
    assert {c["target"] for c in timed} == {"onnxruntime", "openvino"}
    rec = job.tune["recommendation"]
    assert rec["id"] == min((c for c in timed if c["meets_constraints"]), key=lambda c: c["p50_ms"])["id"]
    published = job.targets["tune"].published
    assert published is not None and published["name"] == "client-tuned"
    assert ("model.onnx" in files) if rec["target"] == "onnxruntime" else {"model.xml", "model.bin"} <= files


def test_cancel_stops_a_running_job_and_wait_times_out_before(service: Service, cnn_onnx: Path) -> None:
    # A benchmark long enough that the job is surely running when it is cancelled.
    spec = {"targets": ["onnxruntime"], "benchmark": {"batch_sizes": [1], "iterations": 100000, "warmup": 1}}
    with Client(service.url) as kiln:
        job = kiln.compile(cnn_onnx, spec, wait=False, cache=False)
        for event in job.follow(timeout=120):
            if event.type == "step_started" and event.step == "export:onnxruntime":
                break
        with pytest.raises(KilnError) as timed_out:
            job.wait(timeout=0.2)
        assert timed_out.value.code == "TIMEOUT" and timed_out.value.details["job_id"] == job.id
        assert job.cancel().status == "cancelled"
        job.wait(timeout=60)
        assert job.status == "cancelled" and not job.ok
        deadline = time.monotonic() + 60  # the job is cancelled at once; its running step stops soon after
        while any(s.status == "running" for s in job.refresh().steps) and time.monotonic() < deadline:
            time.sleep(0.2)
        export = next(s for s in job.steps if s.id == "export:onnxruntime")
        assert export.status == "cancelled" and export.error is not None and export.error.code == "CANCELLED"
        with pytest.raises(KilnError) as failed:
            job.raise_for_failure()
        assert failed.value.code == "CANCELLED" and failed.value.details["status"] == "cancelled"
        # Cancelling again changes nothing and is no error.
        assert kiln.cancel(job.id).status == "cancelled"


def test_resubmit_plan_list_and_logs(serve: Service, cnn_onnx: Path) -> None:
    with Client(serve.url) as kiln:
        first = kiln.compile(cnn_onnx, FAST, timeout=120)
        again = kiln.resubmit(first.id, {**FAST, "targets": ["onnxruntime"]}, wait=True, timeout=120)
        assert again.id != first.id and again.ok and list(again.targets) == ["onnxruntime"]
        assert again.source.sha256 == first.source.sha256
        # Its conversions came from the cache (it publishes under a new name: `cnn`, one target).
        assert all(s.cached for s in again.steps if s.kind != "publish" and s.status == "succeeded")
        plan = kiln.plan({"targets": ["openvino"]}, source_format="onnx")
        assert isinstance(plan, Plan) and plan.routes == {"openvino": "onnx → optimize → openvino_ir ⇒ openvino"}
        assert all(isinstance(s, PlanStep) for s in plan.steps) and "kiln.openvino" in plan.queues
        page = kiln.jobs(limit=2, sort="-created_at")
        assert page.count >= 2 and [j.id for j in page.data] == [again.id, first.id]
        log = kiln.logs(again.id, tail=2)
        assert log.splitlines()[-1].split()[1] == "finished"


def test_refusals_raise_one_exception_with_the_apis_code_and_hint(serve: Service, cnn_onnx: Path) -> None:
    with Client(serve.url) as kiln:
        with pytest.raises(KilnError) as bad:
            kiln.compile(cnn_onnx, {"targets": ["onnxruntime"], "precision": "fp7"})
        assert bad.value.code == "INVALID_SPEC" and bad.value.status == 422
        assert "precision" in bad.value.message and bad.value.hint
        assert bad.value.details["errors"][0]["field"] == "precision"
        with pytest.raises(KilnError) as missing:
            kiln.job("0" * 32)
        assert (missing.value.code, missing.value.status) == ("NOT_FOUND", 404)
        assert str(missing.value) == f"NOT_FOUND: no job {'0' * 32}"
        with pytest.raises(KilnError) as no_file:
            kiln.compile(serve.root / "nowhere.onnx", FAST)
        assert no_file.value.code == "SOURCE_UNREADABLE"
    closed = free_port()
    with Client(f"http://127.0.0.1:{closed}", retries=2, backoff=0.01) as nobody, pytest.raises(KilnError) as down:
        nobody.job("x")
    assert (
        down.value.code == "SERVICE_UNAVAILABLE" and down.value.status is None and "ConnectError" in down.value.message
    )


def test_idempotent_calls_are_retried_after_refused_connections_and_proxy_errors(
    serve: Service, cnn_onnx: Path
) -> None:
    with Client(serve.url) as kiln:
        job = kiln.compile(cnn_onnx, FAST, timeout=120)
    # The first connection is closed at once, the second answered 503 by "a proxy"; the third passes.
    with FaultProxy(serve.port, {0: "refuse", 1: "status:503"}) as proxy, Client(proxy.url, backoff=0.01) as kiln:
        assert kiln.job(job.id).id == job.id
        assert proxy.connections == 3
    # Without retries the 503 page comes back as SERVICE_UNAVAILABLE, not as a JSON decoding error.
    with FaultProxy(serve.port, {0: "status:502"}) as proxy, Client(proxy.url, retries=0) as kiln:
        with pytest.raises(KilnError) as err:
            kiln.job(job.id)
        assert err.value.code == "SERVICE_UNAVAILABLE" and err.value.status == 502 and "nginx" in err.value.message


def test_follow_resumes_after_a_dropped_stream_without_losing_or_repeating_events(
    serve: Service, cnn_onnx: Path
) -> None:
    with Client(serve.url) as kiln:
        job = kiln.compile(cnn_onnx, FAST, timeout=120)
    direct = read_sse(serve.url, job.id)
    whole = len(httpx.get(f"{serve.url}/jobs/{job.id}/events").content)
    # The stream's first connection breaks off half-way, mid-event; the client resumes.
    with FaultProxy(serve.port, {0: f"cut_after:{whole // 2}"}) as proxy, Client(proxy.url, backoff=0.01) as kiln:
        events = list(kiln.follow(job.id))
        assert proxy.connections == 2
        resumed = proxy.requests[1].decode("latin-1").lower()
    assert [e.data for e in events] == direct  # nothing lost, nothing twice
    assert all(isinstance(e, Event) for e in events) and events[-1].type == "finished"
    resumed_after = int(resumed.split("last-event-id: ")[1].split("\r\n")[0])
    assert resumed_after in [e.id for e in events[:-1]]  # resumed after an event it had, before the end


def test_the_upload_streams_from_disk(serve: Service, tmp_path: Path) -> None:
    big = tmp_path / "big.onnx"
    with open(big, "wb") as fh:  # 64 MiB that are not a model: refused once the server has read it all
        fh.truncate(64 * 1024 * 1024)
    tracemalloc.start()
    try:
        with Client(serve.url) as kiln, pytest.raises(KilnError) as refused:
            kiln.compile(big, {"targets": ["onnxruntime"]})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.code in ("SOURCE_UNREADABLE", "UNSUPPORTED_FORMAT"), refused.value
    assert peak < 8 * 1024 * 1024, f"the client held {peak / 2**20:.1f} MiB while uploading 64 MiB"


def test_typed_results_carry_the_api_schemas_field_names(serve: Service) -> None:
    schemas = httpx.get(f"{serve.url}/openapi.json").json()["components"]["schemas"]
    pairs = {
        "JobPublic": JobInfo,
        "TargetPublic": Target,
        "StepPublic": Step,
        "SourcePublic": Source,
        "ErrorPublic": ErrorInfo,
        "PlanPublic": Plan,
        "PlanStepPublic": PlanStep,
    }
    for schema, cls in pairs.items():
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "raw"]
        assert fields == list(schemas[schema]["properties"]), schema


def test_the_client_package_depends_on_httpx_only() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[1] / "clients" / "python"
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert [d.split(">")[0].split("=")[0] for d in project["dependencies"]] == ["httpx"]
    assert (root / "kiln_client" / "py.typed").exists()
    # Importing it pulls in none of Kiln's service or engine packages.
    code = "import sys, kiln_client; print(sorted(m for m in ('api', 'services', 'onnx', 'numpy', 'pydantic') if m in sys.modules))"
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"


def _header(raw: bytes, name: str) -> str:
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    return next(line.split(":", 1)[1].strip() for line in head.split("\r\n") if line.lower().startswith(name + ":"))


def test_a_submit_repeated_after_a_dropped_answer_makes_one_job(serve: Service, cnn_onnx: Path) -> None:
    name = f"once-{uuid.uuid4().hex[:8]}"
    # The server records the job, but the answer never reaches the client, which sends it again.
    with FaultProxy(serve.port, {0: "drop_response"}) as proxy, Client(proxy.url, backoff=0.01) as kiln:
        job = kiln.compile(cnn_onnx, {**FAST, "name": name}, timeout=120)
        keys = {_header(proxy.requests[i], "idempotency-key") for i in (0, 1)}
    assert len(keys) == 1 and job.ok
    with Client(serve.url) as kiln:
        page = kiln.jobs(name=name)
    assert page.count == 1 and page.data[0].id == job.id


def test_the_idempotency_key_header_on_compile_and_resubmit(serve: Service, cnn_onnx: Path) -> None:
    key = uuid.uuid4().hex
    spec = {**FAST, "name": f"idem-{key[:8]}"}
    first = submit(serve.url, cnn_onnx, spec, headers={"Idempotency-Key": key})
    assert first.status_code == 202, first.text
    job_id = first.json()["id"]
    again = submit(serve.url, cnn_onnx, dict(reversed(spec.items())), headers={"Idempotency-Key": key})
    assert again.status_code == 200 and again.json()["id"] == job_id
    assert again.headers["idempotent-replayed"] == "true" and again.headers["location"] == f"/jobs/{job_id}"
    other = submit(serve.url, cnn_onnx, {**spec, "precision": "fp16"}, headers={"Idempotency-Key": key})
    assert other.status_code == 409
    body = other.json()
    assert (
        body["code"] == "IDEMPOTENCY_KEY_REUSED" and body["details"]["job_id"] == job_id and "new key" in body["hint"]
    )
    uncached = submit(serve.url, cnn_onnx, spec, headers={"Idempotency-Key": key}, params={"cache": "false"})
    assert uncached.status_code == 409  # the cache flag is part of the request
    bad = submit(serve.url, cnn_onnx, spec, headers={"Idempotency-Key": "two words"})
    assert bad.status_code == 422 and bad.json()["details"]["errors"][0]["field"] == "Idempotency-Key"
    # Resubmit: the same key and body answer the first new job; another body is refused.
    rkey = uuid.uuid4().hex
    url = f"{serve.url}/jobs/{job_id}/resubmit"
    r1 = httpx.post(url, json={"spec": {**spec, "targets": ["onnxruntime"]}}, headers={"Idempotency-Key": rkey})
    r2 = httpx.post(url, json={"spec": {**spec, "targets": ["onnxruntime"]}}, headers={"Idempotency-Key": rkey})
    r3 = httpx.post(url, json={"spec": {**spec, "targets": ["openvino"]}}, headers={"Idempotency-Key": rkey})
    assert (r1.status_code, r2.status_code, r3.status_code) == (202, 200, 409)
    assert r2.json()["id"] == r1.json()["id"] != job_id
    # The OpenAPI document says all of it.
    paths = httpx.get(f"{serve.url}/openapi.json").json()["paths"]
    for op in (paths["/compile"]["post"], paths["/jobs/{job_id}/resubmit"]["post"]):
        header = next(p for p in op["parameters"] if p["name"] == "Idempotency-Key")
        assert header["in"] == "header" and "24 h" in header["description"]
        assert {"200", "202", "409"} <= set(op["responses"])
        assert "IDEMPOTENCY_KEY_REUSED" in op["responses"]["409"]["description"]
