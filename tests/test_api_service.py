"""The API around jobs: OpenAPI, bearer-token auth, dry-run planning, engines, probes, metrics, broker outage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from jobs_support import redis_url

from api.app import create_app
from services.settings import Settings
from services.spec import CompileSpec
from workers.app import create_celery_app


def _settings(root: Path, **kw: object) -> Settings:
    base: dict[str, object] = {
        "cache_dir": root / "cache",
        "data_dir": root / "data",
        "repository": str(root / "repo"),
        "artifact_store": str(root / "store"),
        "broker_url": redis_url(14),
    }
    return Settings(**{**base, **kw})


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = _settings(tmp_path_factory.mktemp("svc"))
    with TestClient(create_app(settings, create_celery_app(settings))) as c:
        yield c


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = _settings(tmp_path_factory.mktemp("auth"), auth_enabled=True)
    with TestClient(create_app(settings, create_celery_app(settings))) as c:
        yield c


def test_the_openapi_document_is_complete_and_embeds_the_generated_spec_schema(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    paths = doc["paths"]
    for path, methods in {
        "/compile": {"post"},
        "/jobs": {"get"},
        "/jobs/{job_id}": {"get", "delete"},
        "/jobs/{job_id}/events": {"get"},
        "/jobs/{job_id}/logs": {"get"},
        "/jobs/{job_id}/artifacts/{target}": {"get"},
        "/plan": {"post"},
        "/engines": {"get"},
        "/repository": {"get"},
        "/healthz": {"get"},
        "/readyz": {"get"},
        "/metrics": {"get"},
    }.items():
        assert methods <= set(paths[path]), path
    schemas = doc["components"]["schemas"]
    generated = CompileSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    generated.pop("$defs")
    assert schemas["CompileSpec"] == generated  # the schema `kiln schema` prints, not a copy of it
    assert schemas["CompileSpec"]["required"] == ["targets"]
    upload = paths["/compile"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert upload["schema"] == {"$ref": "#/components/schemas/JobCreate"}
    assert upload["encoding"] == {"spec": {"contentType": "application/json"}}
    body = schemas["JobCreate"]
    assert body["properties"]["spec"] == {"$ref": "#/components/schemas/CompileSpec"}
    assert body["properties"]["model"]["format"] == "binary" and body["required"] == ["model", "spec"]
    assert {"413", "422", "400", "503"} <= set(paths["/compile"]["post"]["responses"])
    assert set(schemas["JobPublic"]["properties"]["status"]["enum"]) == {
        "queued",
        "running",
        "succeeded",
        "failed",
        "cancelled",
    }
    assert "TargetPublic" in schemas and "ErrorPublic" in schemas
    # Every error answer is ErrorPublic, 422 included (FastAPI's HTTPValidationError is never sent).
    assert "HTTPValidationError" not in schemas
    for path, methods in paths.items():
        for method, op in methods.items():
            for status, answer in op["responses"].items():
                if int(status) >= 400 and path != "/readyz":
                    assert answer["content"] == {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ErrorPublic"}}
                    }, (method, path, status)
    # The event stream: one typed event per item, its data a JobEventPublic (tests/test_api_schemathesis.py).
    stream = paths["/jobs/{job_id}/events"]["get"]["responses"]["200"]["content"]
    data = stream["text/event-stream"]["itemSchema"]["properties"]["data"]
    assert list(stream["text/event-stream"]) == ["itemSchema"]
    assert data["contentSchema"] == {"$ref": "#/components/schemas/JobEventPublic"}
    assert paths["/compile"]["post"]["operationId"] == "submit"
    # Every $ref resolves inside the document.
    text = json.dumps(doc)
    for ref in {part.split('"')[0] for part in text.split('"$ref": "#/components/schemas/')[1:]}:
        assert ref in schemas, ref


def test_health_probes_need_no_token_and_everything_else_does(secured: TestClient) -> None:
    assert secured.get("/healthz").status_code == 200
    assert secured.get("/readyz").status_code == 200
    # Every operation the app documents, read from its own OpenAPI document: a route added
    # without auth fails here.
    checked = set()
    for route, operations in secured.app.openapi()["paths"].items():  # type: ignore[attr-defined]
        if route in ("/healthz", "/readyz"):
            continue
        path = route.replace("{job_id}", "0" * 32).replace("{target}", "onnxruntime")
        for method in operations:
            r = secured.request(method.upper(), path)
            assert r.status_code == 401, (method, route, r.text)
            assert r.json()["code"] == "UNAUTHORIZED" and r.headers["www-authenticate"] == "Bearer"
            checked.add((method.upper(), route))
    assert {
        ("DELETE", "/jobs/{job_id}"),
        ("POST", "/plan"),
        ("POST", "/compile"),
        ("GET", "/jobs/{job_id}/logs"),
    } <= checked
    assert len(checked) >= 11, checked
    for path in ("/metrics", "/openapi.json"):  # served outside the document
        assert secured.get(path).status_code == 401, path
    r = secured.get("/jobs", headers={"Authorization": "Bearer kiln_nope_nope"})
    assert r.status_code == 401 and "unknown or revoked" in r.json()["message"]
    assert secured.get("/docs").status_code == 404  # the interactive page cannot send a token


def test_a_read_token_reads_but_may_not_submit_or_cancel(secured: TestClient, cnn_onnx: Path) -> None:
    tokens = secured.app.state.tokens  # type: ignore[attr-defined]
    reader = {"Authorization": f"Bearer {tokens.create_token('reader', ['read'])}"}
    writer = {"Authorization": f"Bearer {tokens.create_token('writer', ['write'])}"}
    assert secured.get("/jobs", headers=reader).status_code == 200
    assert "/compile" in secured.get("/openapi.json", headers=reader).json()["paths"]
    files = {
        "model": ("m.onnx", cnn_onnx.read_bytes()),
        "spec": (None, '{"targets": ["onnxruntime"], "wait_for_workers": true}'),
    }
    r = secured.post("/compile", files=files, headers=reader)
    assert r.status_code == 403 and r.json()["code"] == "FORBIDDEN" and "write" in r.json()["message"]
    r = secured.post("/compile", files=files, headers=writer)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert secured.delete(f"/jobs/{job_id}", headers=reader).status_code == 403
    assert secured.delete(f"/jobs/{job_id}", headers=writer).status_code == 202
    assert secured.get(f"/jobs/{job_id}", headers=writer).json()["status"] == "cancelled"
    # Revoked tokens stop working (once the few-second verification cache has let go).
    tokens.revoke_token("writer")
    secured.app.state.token_cache._items.clear()  # type: ignore[attr-defined]
    assert secured.get("/jobs", headers=writer).status_code == 401


def test_plan_is_a_dry_run_naming_routes_and_queues(client: TestClient) -> None:
    r = client.post("/plan", json={"source_format": "onnx", "spec": {"targets": ["onnxruntime", "openvino"]}})
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["routes"]["openvino"] == "onnx → optimize → openvino_ir ⇒ openvino"
    assert plan["queues"] == ["kiln.onnxruntime", "kiln.openvino"]
    assert "optimize" in plan["shared_steps"]
    assert {s["id"] for s in plan["steps"]} >= {"reference", "export:openvino", "publish:onnxruntime"}
    assert set(plan["engines_without_workers"]) == {"onnxruntime", "openvino"}  # no worker in this test
    # openvino's fallback goes through TensorFlow (onnx2tf); its steps are listed, flagged, off the queues above.
    assert plan["fallback_routes"] == {
        "onnxruntime": [],
        "openvino": ["onnx → optimize → savedmodel → openvino_ir ⇒ openvino"],
    }
    fallback = {s["id"]: s["queue"] for s in plan["steps"] if s["fallback"]}
    assert fallback["optimize/onnx-to-savedmodel"] == "kiln.tensorflow" and "export:openvino@2" in fallback
    assert client.get("/jobs").json()["count"] == 0  # nothing was submitted


def test_plan_explains_no_route_and_names_bad_fields(client: TestClient) -> None:
    r = client.post("/plan", json={"source_format": "openvino_ir", "spec": {"targets": ["onnxruntime"]}})
    assert r.status_code == 422
    body = r.json()
    assert body["code"] == "NO_ROUTE" and body["details"]["reachable_formats"] == ["openvino_ir"]
    assert "openvino" in body["hint"]
    r = client.post("/plan", json={"source_format": "onnx", "spec": {"targets": ["coreml"]}})
    assert r.status_code == 422
    body = r.json()
    assert body["code"] == "INVALID_SPEC" and body["details"]["errors"][0]["field"] == "spec.targets.0"
    assert "onnxruntime" in body["hint"] and "tensorrt" in body["hint"]


def test_engines_lists_live_workers_and_their_versions(client: TestClient) -> None:
    workers = client.app.state.workers  # type: ignore[attr-defined]
    workers.worker_heartbeat(
        "kiln-openvino-1@test",
        engines=["openvino"],
        versions={"openvino": {"openvino": "2026.4.1"}},
        pid=1,
        concurrency=2,
    )
    body = client.get("/engines").json()
    engines = {e["name"]: e for e in body["engines"]}
    assert engines["openvino"] == {
        "name": "openvino",
        "queue": "kiln.openvino",
        "workers": 1,
        "versions": {"openvino": "2026.4.1"},
        "devices": [],  # a CPU worker reports no GPU
    }
    assert engines["tensorflow"]["workers"] == 0
    assert [w["hostname"] for w in body["workers"]] == ["kiln-openvino-1@test"]
    plan = client.post("/plan", json={"source_format": "onnx", "spec": {"targets": ["openvino"]}}).json()
    assert plan["engines_without_workers"] == ["onnxruntime"]
    workers.worker_stopped("kiln-openvino-1@test")


def test_metrics_count_requests_by_route_and_report_jobs_and_queues(client: TestClient) -> None:
    client.get("/jobs/unknown-id")
    text = client.get("/metrics").text
    assert 'kiln_http_requests_total{method="GET",route="/jobs/{job_id}",status="404"}' in text
    assert 'kiln_jobs{status="queued"}' in text
    assert 'kiln_queue_messages{queue="kiln.onnxruntime"}' in text
    assert "kiln_http_request_seconds_bucket" in text


def test_a_broker_outage_is_503_on_readyz_and_submit_and_the_job_is_kept(tmp_path: Path, cnn_onnx: Path) -> None:
    settings = _settings(tmp_path, broker_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(settings, create_celery_app(settings))) as c:
        r = c.get("/readyz")
        assert r.status_code == 503
        checks = r.json()["checks"]
        assert checks["database"] == "ok" and checks["storage"] == "ok" and checks["broker"] != "ok"
        files = {
            "model": ("m.onnx", cnn_onnx.read_bytes()),
            "spec": (None, '{"targets": ["onnxruntime"], "wait_for_workers": true}'),
        }
        r = c.post("/compile", files=files)
        assert r.status_code == 503 and r.json()["code"] == "SERVICE_UNAVAILABLE"
        job_id = r.json()["details"]["job_id"]
        job = c.get(f"/jobs/{job_id}").json()  # recorded, and says why it did not run
        assert job["status"] == "failed" and job["error"]["code"] == "SERVICE_UNAVAILABLE"


def test_readyz_says_only_ok_or_fail_to_a_caller_without_a_token(tmp_path: Path) -> None:
    """The broker's address and its driver's error are for token holders; a probe gets ok/fail and the status."""
    admin = "kiln_readyz01_" + "r" * 40
    settings = _settings(tmp_path, broker_url="redis://127.0.0.1:1/0", auth_enabled=True, admin_token=admin)
    with TestClient(create_app(settings, create_celery_app(settings))) as c:
        anonymous = c.get("/readyz")
        assert anonymous.status_code == 503
        assert anonymous.json() == {
            "status": "unavailable",
            "checks": {"broker": "fail", "database": "ok", "storage": "ok"},
            "starting": [],
        }
        assert "127.0.0.1" not in anonymous.text and "Error" not in anonymous.text
        forged = c.get("/readyz", headers={"Authorization": "Bearer kiln_nobody_x"})
        assert forged.json()["checks"]["broker"] == "fail"
        reader = c.get("/readyz", headers={"Authorization": f"Bearer {admin}"})
        assert reader.status_code == 503
        broker = reader.json()["checks"]["broker"]
        assert broker not in ("ok", "fail") and "Error" in broker  # what failed, for the operator
