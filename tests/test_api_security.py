"""Safe defaults in one process: production settings, secrets from files, the cross-origin and Host
guard, tenants through the API, and the bounds on an upload's in-memory parts.

The same behaviours against real `kiln serve` and `kiln api` + worker processes are in
tests/test_service_security.py.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from jobs_support import KILN_CMD, redis_url, service_env
from pydantic import ValidationError

from api.app import create_app
from api.upload import MAX_PARTS, MAX_TEXT_BYTES
from services.repository.signing_keys import generate_signing_key
from services.settings import Settings, get_settings
from workers.app import create_celery_app

SECRET = "k" * 40
PRODUCTION: dict[str, Any] = {
    "environment": "production",
    "auth_enabled": True,
    "database_url": "postgresql+psycopg://kiln:Gx7uQ2rLw9pZ@db:5432/kiln",
    "broker_url": "redis://redis:6379/0",
    "session_secret": SECRET,
    "s3_access_key_id": "kiln",
    "s3_secret_access_key": "qQ8yU3nV6tR1wE5mK2pL9sD4",
    "signing_key": generate_signing_key().decode(),
}


def _settings(root: Path, **kw: Any) -> Settings:
    base: dict[str, Any] = {
        "cache_dir": root / "cache",
        "data_dir": root / "data",
        "repository": str(root / "repo"),
        "artifact_store": str(root / "store"),
        "broker_url": redis_url(14),
    }
    return Settings(**{**base, **kw})


# --- settings ---------------------------------------------------------------------------------


def test_production_takes_generated_credentials() -> None:
    assert Settings(**PRODUCTION).environment.value == "production"


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"auth_enabled": False}, "KILN_AUTH_ENABLED must be true"),
        ({"database_url": "postgresql+psycopg://kiln:kiln@postgres:5432/kiln"}, "KILN_DATABASE_URL carries a default"),
        ({"database_url": "postgresql://postgres:postgres@db/kiln"}, "KILN_DATABASE_URL carries a default"),
        ({"s3_secret_access_key": "kiln-minio-secret"}, "KILN_S3_SECRET_ACCESS_KEY is a default"),
        ({"s3_secret_access_key": "minioadmin"}, "KILN_S3_SECRET_ACCESS_KEY is a default"),
        ({"session_secret": ""}, "KILN_SESSION_SECRET must be set"),
        ({"session_secret": "short"}, "KILN_SESSION_SECRET must be set"),
        ({"admin_token": "admin"}, "KILN_ADMIN_TOKEN must be a generated token"),
        ({"signing_key": ""}, "KILN_SIGNING_KEY must be set"),
    ],
)
def test_production_refuses_default_credentials_and_anonymous_access(change: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        Settings(**{**PRODUCTION, **change})


def test_settings_are_read_from_a_secrets_directory_and_the_environment_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    (secrets_dir / "KILN_ADMIN_TOKEN").write_text("kiln_0123abcd_from-the-file\n")
    (secrets_dir / "KILN_SESSION_SECRET").write_text(SECRET)
    (secrets_dir / "KILN_DATABASE_URL").write_text("postgresql://kiln:fromfile@db/kiln")
    monkeypatch.setenv("KILN_SECRETS_DIR", str(secrets_dir))
    monkeypatch.setenv("KILN_DATABASE_URL", "postgresql://kiln:fromenv@db/kiln")
    get_settings.cache_clear()
    try:
        s = get_settings()
        assert s.admin_token.get_secret_value() == "kiln_0123abcd_from-the-file"  # the file, stripped
        assert s.session_secret.get_secret_value() == SECRET
        assert s.database_url == "postgresql://kiln:fromenv@db/kiln"
    finally:
        get_settings.cache_clear()


def test_an_api_without_auth_refuses_to_listen_beyond_loopback(tmp_path: Path) -> None:
    env = service_env(cache_dir=tmp_path / "cache", database_url=f"sqlite:///{tmp_path / 'k.db'}")
    for command in (["api", "--host", "0.0.0.0"], ["serve", "--host", "192.0.2.1", "--repo", str(tmp_path / "r")]):
        done = subprocess.run([*KILN_CMD, *command], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stdout + done.stderr
        said = done.stdout + done.stderr
        assert "INVALID_SETTINGS" in said and "only on loopback" in said, said
        assert "Traceback" not in said
    bad = service_env(cache_dir=tmp_path / "cache", environment="production")
    done = subprocess.run([*KILN_CMD, "api"], env=bad, capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 2 and "INVALID_SETTINGS" in said and "KILN_AUTH_ENABLED" in said, said


# --- cross-origin and Host guard -----------------------------------------------------------------


@pytest.fixture(scope="module")
def open_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """Auth off, as `kiln serve` on a laptop: every caller is an admin."""
    settings = _settings(tmp_path_factory.mktemp("open"), allowed_origins="https://ci.example:8443")
    with TestClient(create_app(settings, create_celery_app(settings))) as c:
        yield c


PLAN = {"source_format": "onnx", "spec": {"targets": ["onnxruntime"]}}


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://attacker.example"},
        {"Origin": "null"},
        {"Origin": "http://testserver.attacker.example"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "cross-site", "Origin": "http://testserver"},
    ],
)
def test_a_cross_site_state_change_is_forbidden_with_auth_off(open_client: TestClient, headers: dict[str, str]) -> None:
    for method, path, kw in (
        ("POST", "/plan", {"json": PLAN}),
        ("POST", "/compile", {"files": {"model": ("m.onnx", b"x"), "spec": (None, "{}")}}),
        ("DELETE", "/jobs/" + "0" * 32, {}),
        ("POST", f"/jobs/{'0' * 32}/resubmit", {}),
        ("POST", "/ui/login", {"data": {"token": "x"}}),
    ):
        r = open_client.request(method, path, headers=headers, **kw)
        assert r.status_code == 403, (method, path, headers, r.text)
        assert r.json()["code"] == "FORBIDDEN" and r.json()["hint"], r.text


def test_same_origin_allowed_origins_and_pipelines_go_through(open_client: TestClient) -> None:
    for headers in (
        {},  # curl, httpx, the Python client: no Origin at all
        {"Origin": "http://testserver", "Sec-Fetch-Site": "same-origin"},
        {"Origin": "https://ci.example:8443"},  # KILN_ALLOWED_ORIGINS
        {"Sec-Fetch-Site": "none"},  # typed into the address bar
        {"Origin": "https://testserver"},  # this host's https pages, behind a TLS-terminating proxy
    ):
        r = open_client.post("/plan", json=PLAN, headers=headers)
        assert r.status_code == 200, (headers, r.text)
    # Reads are not state changes: a foreign page's GET is answered (CORS keeps the body from it).
    assert open_client.get("/healthz", headers={"Origin": "http://attacker.example"}).status_code == 200


def test_a_foreign_host_name_is_refused_when_allowed_hosts_are_set(tmp_path: Path) -> None:
    settings = _settings(tmp_path, allowed_hosts="127.0.0.1,localhost,[::1]")
    with TestClient(create_app(settings, create_celery_app(settings)), base_url="http://127.0.0.1:8000") as c:
        assert c.get("/jobs").status_code == 200
        assert c.get("/jobs", headers={"Host": "localhost:9999"}).status_code == 200
        assert c.get("/jobs", headers={"Host": "[::1]:8000"}).status_code == 200
        rebound = c.get("/jobs", headers={"Host": "attacker.example:8000"})  # DNS rebinding to 127.0.0.1
        assert rebound.status_code == 403 and rebound.json()["code"] == "FORBIDDEN"
        assert "attacker.example" in rebound.json()["message"]


# --- tenants through the API --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, dict[str, dict[str, str]]]]:
    settings = _settings(tmp_path_factory.mktemp("tenants"), auth_enabled=True, admin_token="kiln_a11ce000_" + "z" * 43)
    app = create_app(settings, create_celery_app(settings))
    with TestClient(app) as c:
        store = app.state.tokens
        heads = {
            name: {"Authorization": f"Bearer {store.create_token(name, scopes, tenant)}"}
            for name, scopes, tenant in (
                ("a-read", ["read"], "team-a"),
                ("a-write", ["write"], "team-a"),
                ("b-write", ["write"], "team-b"),
            )
        }
        heads["admin"] = {"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"}
        yield c, heads


def _submit(client: TestClient, model: Path, headers: dict[str, str], name: str) -> Any:
    spec = {"targets": ["onnxruntime"], "name": name, "wait_for_workers": True}
    return client.post(
        "/compile", files={"model": (model.name, model.read_bytes()), "spec": (None, json.dumps(spec))}, headers=headers
    )


def test_tenants_see_and_change_only_their_own_jobs_and_names(
    tenants: tuple[TestClient, dict[str, dict[str, str]]], cnn_onnx: Path
) -> None:
    client, h = tenants
    b_job = _submit(client, cnn_onnx, h["b-write"], "b-model")
    assert b_job.status_code == 202, b_job.text
    b_id = b_job.json()["id"]
    a_id = _submit(client, cnn_onnx, h["a-write"], "a-model").json()["id"]
    assert client.get(f"/jobs/{a_id}", headers=h["a-read"]).json()["tenant"] == "team-a"
    # Tenant A's tokens find nothing of B's: the same 404 as for a job that does not exist.
    for token in ("a-read", "a-write"):
        for path in (
            f"/jobs/{b_id}",
            f"/jobs/{b_id}/logs",
            f"/jobs/{b_id}/events",
            f"/jobs/{b_id}/artifacts/onnxruntime",
        ):
            r = client.get(path, headers=h[token])
            assert r.status_code == 404 and r.json()["code"] == "NOT_FOUND", (token, path, r.text)
            assert r.json()["message"] == f"no job {b_id}"
        listed = client.get("/jobs", headers=h[token], params={"limit": 500}).json()
        assert b_id not in {j["id"] for j in listed["data"]} and {j["tenant"] for j in listed["data"]} == {"team-a"}
        assert client.get("/jobs", headers=h[token], params={"tenant": "team-b"}).json() == {"data": [], "count": 0}
    assert client.delete(f"/jobs/{b_id}", headers=h["a-write"]).status_code == 404
    assert client.post(f"/jobs/{b_id}/resubmit", headers=h["a-write"]).status_code == 404
    assert client.get(f"/jobs/{b_id}", headers=h["b-write"]).json()["status"] == "queued"  # untouched
    # A cannot publish under B's model name, from an upload or a resubmission of its own job.
    taken = _submit(client, cnn_onnx, h["a-write"], "b-model")
    assert taken.status_code == 403 and taken.json()["code"] == "FORBIDDEN", taken.text
    assert taken.json()["details"]["names"] == ["b-model"]
    again = client.post(
        f"/jobs/{a_id}/resubmit", headers=h["a-write"], json={"spec": {"targets": ["onnxruntime"], "name": "b-model"}}
    )
    assert again.status_code == 403 and again.json()["code"] == "FORBIDDEN"
    # The admin token (KILN_ADMIN_TOKEN, made live at start) sees and cancels every tenant's jobs.
    every = {j["id"] for j in client.get("/jobs", headers=h["admin"], params={"limit": 500}).json()["data"]}
    assert {a_id, b_id} <= every
    only_b = client.get("/jobs", headers=h["admin"], params={"tenant": "team-b", "limit": 500}).json()["data"]
    assert b_id in {j["id"] for j in only_b} and {j["tenant"] for j in only_b} == {"team-b"}
    assert client.delete(f"/jobs/{b_id}", headers=h["admin"]).json()["status"] == "cancelled"
    # A job an admin resubmits stays in its own tenant.
    re_b = client.post(f"/jobs/{b_id}/resubmit", headers=h["admin"]).json()["id"]
    assert client.get(f"/jobs/{re_b}", headers=h["b-write"]).json()["tenant"] == "team-b"


def test_a_cached_job_body_is_not_served_to_another_tenant(
    tenants: tuple[TestClient, dict[str, dict[str, str]]], cnn_onnx: Path
) -> None:
    client, h = tenants
    b_id = _submit(client, cnn_onnx, h["b-write"], "b-cached").json()["id"]
    client.delete(f"/jobs/{b_id}", headers=h["b-write"])
    final = client.get(f"/jobs/{b_id}", headers=h["b-write"])  # final now: cached, served without a read
    assert final.status_code == 200 and final.json()["status"] == "cancelled"
    assert client.get(f"/jobs/{b_id}", headers=h["b-write"]).status_code == 200
    r = client.get(f"/jobs/{b_id}", headers=h["a-read"])
    assert r.status_code == 404 and r.json()["code"] == "NOT_FOUND"


# --- upload bounds ----------------------------------------------------------------------------


def _multipart(parts: list[tuple[str, bytes]], boundary: str = "b0undary") -> tuple[bytes, dict[str, str]]:
    body = b""
    for header, content in parts:
        body += f"--{boundary}\r\n".encode() + header.encode() + b"\r\n\r\n" + content + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def test_an_upload_bounds_its_text_parts_in_number_and_size_and_its_headers(
    open_client: TestClient, cnn_onnx: Path
) -> None:
    model = ('Content-Disposition: form-data; name="model"; filename="m.onnx"', cnn_onnx.read_bytes())
    spec = ('Content-Disposition: form-data; name="spec"', b'{"targets": ["onnxruntime"], "wait_for_workers": true}')
    extra = [(f'Content-Disposition: form-data; name="x{i}"', b"1") for i in range(MAX_PARTS)]
    body, headers = _multipart([model, spec, *extra])
    r = open_client.post("/compile", content=body, headers=headers)
    assert r.status_code == 422 and r.json()["code"] == "INVALID_SPEC" and f"more than {MAX_PARTS} parts" in r.text
    # Each text part may be up to 1 MiB, but all of them together no more than MAX_TEXT_BYTES.
    fat = [(f'Content-Disposition: form-data; name="f{i}"', b"y" * (1 << 20)) for i in range(3)]
    body, headers = _multipart([spec, *fat, model])
    r = open_client.post("/compile", content=body, headers=headers)
    assert r.status_code == 413 and r.json()["code"] == "UPLOAD_TOO_LARGE"
    assert r.json()["details"]["limit"] == MAX_TEXT_BYTES
    # A part's headers are bounded by python-multipart itself (4 KiB a line, 8 lines).
    long_header = ('Content-Disposition: form-data; name="spec"; junk="' + "z" * 8192 + '"', b"{}")
    body, headers = _multipart([long_header, model])
    r = open_client.post("/compile", content=body, headers=headers)
    assert r.status_code == 400 and "Maximum header size exceeded" in r.json()["message"], r.text
    # Within the bounds the same upload is accepted.
    body, headers = _multipart([spec, *extra[: MAX_PARTS - 3], model])
    assert open_client.post("/compile", content=body, headers=headers).status_code == 202
