"""Every error the API gives is a JSON body with a stable code: the framework's own refusals,
inputs that used to crash a route, a database that does not answer, and an unexpected bug,
which must also leave the client's keep-alive connection usable."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from jobs_support import free_port, redis_url

from api.app import create_app
from services.settings import Settings
from workers.app import create_celery_app

#: A PostgreSQL URL nothing listens on: the job store's database is down.
DEAD_DATABASE = "postgresql+psycopg://postgres@127.0.0.1:1/kiln"
DEEP = "[" * 100_000 + "]" * 100_000


def _settings(root: Path, **kw: object) -> Settings:
    base: dict[str, object] = {
        "cache_dir": root / "cache",
        "repository": str(root / "repo"),
        "artifact_store": str(root / "store"),
        "broker_url": redis_url(14),
    }
    return Settings(**{**base, **kw})


def _app(settings: Settings) -> FastAPI:
    return create_app(settings, create_celery_app(settings))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with TestClient(_app(_settings(tmp_path_factory.mktemp("errors"))), raise_server_exceptions=False) as c:
        yield c


def _assert_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["code"] == code, body
    assert body["message"] and body["hint"]
    assert "Traceback" not in r.text and "/work/" not in r.text and ".py" not in r.text
    return dict(body)


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "code"),
    [
        ("GET", "/no-such-route", {}, 404, "NOT_FOUND"),
        ("PUT", "/jobs", {}, 405, "METHOD_NOT_ALLOWED"),
        ("DELETE", "/compile", {}, 405, "METHOD_NOT_ALLOWED"),
        # A body the framework cannot even parse (its JSON decoder recurses per level).
        ("POST", "/plan", {"content": DEEP, "headers": {"content-type": "application/json"}}, 400, "MALFORMED_REQUEST"),
        ("POST", "/plan", {"content": b"{bad", "headers": {"content-type": "application/json"}}, 422, "INVALID_SPEC"),
        # Integers past what the database takes: a 422 naming the field, not an OverflowError.
        ("GET", f"/jobs?offset={10**30}", {}, 422, "INVALID_SPEC"),
        ("GET", f"/jobs?limit={10**30}", {}, 422, "INVALID_SPEC"),
        ("GET", "/jobs/x/events", {"headers": {"last-event-id": str(10**30)}}, 422, "INVALID_SPEC"),
        ("GET", "/jobs?offset=-1", {}, 422, "INVALID_SPEC"),
    ],
)
def test_the_frameworks_own_refusals_and_out_of_range_inputs_have_the_error_shape(
    client: TestClient, method: str, path: str, kwargs: dict[str, Any], status: int, code: str
) -> None:
    _assert_error(client.request(method, path, **kwargs), status, code)


def test_a_method_not_allowed_names_the_allowed_ones(client: TestClient) -> None:
    r = client.put("/jobs")
    _assert_error(r, 405, "METHOD_NOT_ALLOWED")
    assert r.headers["allow"] == "GET"


def test_a_deeply_nested_spec_is_invalid_spec_not_a_crash(client: TestClient) -> None:
    files = {"model": ("m.onnx", b"not a model"), "spec": (None, DEEP)}
    body = _assert_error(client.post("/compile", files=files), 422, "INVALID_SPEC")
    assert "nested too deeply" in body["message"]


def test_every_integer_parameter_is_bounded_in_the_openapi_document(client: TestClient) -> None:
    """The class behind the offset overflow: an unbounded integer reaches the database driver."""
    doc = client.get("/openapi.json").json()
    unbounded = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for param in op.get("parameters", []):
                schema = param.get("schema", {})
                variants = schema.get("anyOf", [schema])
                for v in variants:
                    if v.get("type") == "integer" and "maximum" not in v:
                        unbounded.append(f"{method.upper()} {path} {param['name']}")
    assert unbounded == []


def test_a_database_that_does_not_answer_is_503_on_every_route_that_needs_it(tmp_path: Path, cnn_onnx: Path) -> None:
    settings = _settings(tmp_path, database_url=DEAD_DATABASE)
    with TestClient(_app(settings), raise_server_exceptions=False) as c:
        assert c.get("/readyz").json()["checks"]["database"] != "ok"
        for method, path in [
            ("GET", "/jobs"),
            ("GET", "/jobs/0123"),
            ("GET", "/jobs/0123/logs"),
            ("DELETE", "/jobs/0123"),
        ]:
            body = _assert_error(c.request(method, path), 503, "SERVICE_UNAVAILABLE")
            assert body["details"] == {"service": "database"}
        files = {"model": ("m.onnx", cnn_onnx.read_bytes()), "spec": (None, '{"targets": ["onnxruntime"]}')}
        _assert_error(c.post("/compile", files=files), 503, "SERVICE_UNAVAILABLE")
    left = [p for p in (settings.cache_dir / "api").glob("run-*/uploads/**/*") if p.is_file()]
    assert left == []  # the refused upload is not left behind


class _Server:
    """A real uvicorn server in a thread, for what only a real HTTP connection shows."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def test_after_a_500_or_a_503_the_keep_alive_connection_still_serves_the_next_request(tmp_path: Path) -> None:
    app = _app(_settings(tmp_path, database_url=DEAD_DATABASE))

    # A mock only to provoke the fault: a route with a bug in it, and one that names the
    # client's port so the test sees whether the connection was kept.
    async def broken() -> None:
        raise RuntimeError(f"bug at {__file__}")

    async def peer(request: Request) -> dict[str, Any]:
        assert request.client is not None
        return {"port": request.client.port}

    app.add_api_route("/test-broken", broken)
    app.add_api_route("/test-peer", peer)
    with _Server(app) as base, httpx.Client(base_url=base, timeout=10) as http:
        first = http.get("/test-peer").json()["port"]
        body = _assert_error(http.get("/test-broken"), 500, "INTERNAL")
        assert body["message"] == "internal error: RuntimeError"
        assert http.get("/test-peer").json()["port"] == first  # same connection, not reset
        _assert_error(http.get("/jobs"), 503, "SERVICE_UNAVAILABLE")
        _assert_error(http.get("/no-such-route"), 404, "NOT_FOUND")
        assert http.get("/test-peer").json()["port"] == first
        metrics = http.get("/metrics").text
    assert 'route="/test-broken",status="500"' in metrics  # the middleware still counts it
    assert 'route="/jobs",status="503"' in metrics
    assert json.dumps(body).count("bug at") == 0
