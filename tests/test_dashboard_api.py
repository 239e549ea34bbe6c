"""The API changes the dashboard needs, and the dashboard's server side, without a browser.

GET /jobs filters and sort (SQLite and PostgreSQL), logs with tail/offset on a 100,000-line
log, POST /jobs/{id}/resubmit, the session cookie and its CSRF token, the HTML event stream,
the vendored files' checksums, and bad links answering 4xx pages instead of 5xx.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from jobs_support import migrated_pg, redis_url
from sqlalchemy import update

from api.app import create_app
from api.sessions import CSRF_FIELD, CSRF_HEADER, SESSION_COOKIE
from api.ui import STATIC_DIR
from services.errors import ParityFailed
from services.formats import Format
from services.graph.planner import plan_routes
from services.jobs.models import Job, JobStep
from services.jobs.store import JobFilter, JobStore, NewJob
from services.jobs.tokens import TokenStore
from services.settings import Settings
from services.spec import load_spec
from workers.app import create_celery_app

VENDOR = STATIC_DIR / "vendor"


def _settings(root: Path, **extra: Any) -> Settings:
    return Settings(
        cache_dir=root / "cache",
        data_dir=root / "data",
        repository=str(root / "repo"),
        artifact_store=str(root / "store"),
        broker_url=redis_url(14),
        **extra,
    )


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = _settings(tmp_path_factory.mktemp("dash-api"))
    with TestClient(create_app(settings, create_celery_app(settings))) as c:
        yield c


def _new_job(name: str, spec: dict[str, Any], sha: str = "ab" * 32) -> NewJob:
    parsed = load_spec(spec)
    return NewJob(
        name=name,
        spec=parsed.model_dump(mode="json"),
        plan=plan_routes(Format.ONNX, parsed, default_name=name),
        source_key=f"sources/{sha}",
        source_sha256=sha,
        source_filename="m.onnx",
        source_format="onnx",
    )


def _upload(client: TestClient, model: Path, spec: dict[str, Any], headers: dict[str, str] | None = None) -> str:
    spec = {"wait_for_workers": True, **spec}  # no worker runs beside this app: the jobs only need to exist
    with open(model, "rb") as fh:
        r = client.post(
            "/compile",
            files={"model": (model.name, fh, "application/octet-stream"), "spec": (None, json.dumps(spec))},
            headers=headers,
        )
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


# --- vendored files ---------------------------------------------------------------------


def test_vendored_files_match_their_checksums_and_carry_licences() -> None:
    sums = {}
    for line in (VENDOR / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        sums[name] = digest
    served = sorted(p.name for p in VENDOR.iterdir() if p.suffix in (".js", ".css"))
    assert sorted(sums) == served  # every served file is listed, nothing listed is missing
    for name, digest in sums.items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == digest, name
        assert re.search(r"-\d+\.\d+\.\d+", name), f"{name} carries no version"
    for package in ("htmx-2.0.11", "htmx-ext-sse-2.2.4", "swagger-ui-dist-5.35.0", "redoc-2.5.4"):
        assert (VENDOR / f"{package}.LICENSE").stat().st_size > 100


def test_pages_load_only_vendored_files(client: TestClient) -> None:
    for path in ("/ui/", "/docs", "/redoc"):
        html = client.get(path).text
        refs = re.findall(r"""(?:src|href)=["']([^"']+\.(?:js|css))["']""", html)
        assert refs, path
        for ref in refs:
            assert ref.startswith("/ui/static/"), f"{path} loads {ref} from elsewhere"
            assert client.get(ref).status_code == 200, ref
        assert "cdn" not in html.lower() and "fonts.googleapis" not in html


# --- GET /jobs filters and sort -----------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> JobStore:
    if request.param == "sqlite":
        from services.jobs.migrate import upgrade

        url = f"sqlite:///{tmp_path / 'jobs.db'}"
        upgrade(url)
        return JobStore(url)
    return JobStore(migrated_pg())


def test_job_list_filters_by_target_engine_precision_source_and_date(store: JobStore) -> None:
    tag = f"f{datetime.now(UTC).timestamp():.0f}"[-8:]
    a = store.create_job(_new_job(f"{tag}-a", {"targets": ["onnxruntime"]}, sha="a1" * 32))
    b = store.create_job(_new_job(f"{tag}-b", {"targets": ["openvino"], "precision": "fp16"}, sha="b2" * 32))
    c = store.create_job(
        _new_job(f"{tag}-c", {"targets": ["onnxruntime", "tflite"], "precision": "int8"}, sha="a1" * 32)
    )
    mine = {a, b, c}

    def ids(**kw: Any) -> list[str]:
        rows, _ = store.list_jobs(filters=JobFilter(**kw), limit=500, with_steps=False)
        return [j.id for j in rows if j.id in mine]

    assert set(ids(target="onnxruntime")) == {a, c}
    assert ids(target="tflite") == [c]
    assert set(ids(engine="openvino")) == {b}  # only b has a step on the openvino queue
    assert ids(precision="fp16") == [b]
    assert ids(precision="int8") == [c]
    assert set(ids(source_sha256="a1a1")) == {a, c}  # a prefix is enough
    assert ids() == [c, b, a]  # newest first
    assert ids(sort="created_at", ascending=True) == [a, b, c]
    with store.db.write() as s:
        s.execute(update(Job).where(Job.id == a).values(created_at=datetime.now(UTC) - timedelta(days=3)))
    assert set(ids(created_after=datetime.now(UTC) - timedelta(days=1))) == {b, c}
    assert ids(created_before=datetime.now(UTC) - timedelta(days=1)) == [a]
    assert ids(sort="name", ascending=False)[0] == c


def test_get_jobs_takes_the_filters_and_refuses_bad_ones(client: TestClient, cnn_onnx: Path) -> None:
    job_id = _upload(client, cnn_onnx, {"targets": ["openvino"], "precision": "fp16", "name": "filt"})
    body = client.get("/jobs", params={"precision": "fp16", "target": "openvino", "sort": "name"}).json()
    assert job_id in [j["id"] for j in body["data"]]
    assert job_id not in [j["id"] for j in client.get("/jobs", params={"precision": "int8"}).json()["data"]]
    for bad in ({"sort": "sha"}, {"precision": "fp64"}, {"source_sha256": "xyz"}, {"created_after": "yesterday"}):
        r = client.get("/jobs", params=bad)
        assert r.status_code == 422 and r.json()["code"] == "INVALID_SPEC", (bad, r.text)


# --- logs ---------------------------------------------------------------------------------


def test_a_100000_line_log_has_tail_offset_and_a_bounded_page(client: TestClient, cnn_onnx: Path) -> None:
    job_id = _upload(client, cnn_onnx, {"targets": ["onnxruntime"], "name": "chatty"})
    jobs: JobStore = client.app.state.jobs  # type: ignore[attr-defined]
    lines = "\n".join(f"tool line {i}" for i in range(100_000))
    with jobs.db.write() as s:
        s.execute(update(JobStep).where(JobStep.job_id == job_id, JobStep.step_id == "reference").values(log=lines))

    whole = client.get(f"/jobs/{job_id}/logs")
    total = int(whole.headers["x-log-lines"])
    assert total > 100_000 and len(whole.text.splitlines()) == total
    tail = client.get(f"/jobs/{job_id}/logs", params={"tail": 3})
    assert tail.text.splitlines() == ["tool line 99997", "tool line 99998", "tool line 99999"]
    assert int(tail.headers["x-log-offset"]) == total - 3
    page = client.get(f"/jobs/{job_id}/logs", params={"offset": total - 5, "limit": 2})
    assert page.text.splitlines() == ["tool line 99995", "tool line 99996"]
    assert client.get(f"/jobs/{job_id}/logs", params={"offset": total + 10}).text == ""
    assert client.get(f"/jobs/{job_id}/logs", params={"tail": 0}).status_code == 422

    # The log page shows the tail only: a 100,000-line log does not become a 100,000-line page.
    html = client.get(f"/ui/jobs/{job_id}/log").text
    assert f'data-total="{total}"' in html
    assert "tool line 99999" in html and "tool line 98999\n" not in html
    assert html.count("tool line ") == 1000
    assert f'href="/jobs/{job_id}/logs"' in html  # the whole log is a download


# --- resubmit -----------------------------------------------------------------------------


def test_resubmit_reuses_the_source_with_the_same_or_an_edited_spec(client: TestClient, cnn_onnx: Path) -> None:
    job_id = _upload(client, cnn_onnx, {"targets": ["onnxruntime"], "name": "again"})
    old = client.get(f"/jobs/{job_id}").json()
    r = client.post(f"/jobs/{job_id}/resubmit")
    assert r.status_code == 202, r.text
    same = client.get(r.headers["location"]).json()
    assert same["id"] != job_id and same["source"] == old["source"] and same["spec"] == old["spec"]

    r = client.post(f"/jobs/{job_id}/resubmit", json={"spec": {"targets": ["openvino"], "precision": "fp16"}})
    assert r.status_code == 202, r.text
    edited = client.get(f"/jobs/{r.json()['id']}").json()
    assert list(edited["targets"]) == ["openvino"] and edited["spec"]["precision"] == "fp16"
    assert edited["source"]["sha256"] == old["source"]["sha256"] and edited["name"] == "again"

    bad = client.post(f"/jobs/{job_id}/resubmit", json={"spec": {"targets": ["nope"]}})
    assert bad.status_code == 422 and bad.json()["code"] == "INVALID_SPEC"
    assert client.post("/jobs/0000/resubmit").status_code == 404
    doc = client.get("/openapi.json").json()
    assert "/jobs/{job_id}/resubmit" in doc["paths"]
    params = {p["name"] for p in doc["paths"]["/jobs"]["get"]["parameters"]}
    assert {"target", "engine", "precision", "source_sha256", "created_after", "sort"} <= params
    assert {"tail", "offset", "limit"} <= {p["name"] for p in doc["paths"]["/jobs/{job_id}/logs"]["get"]["parameters"]}


# --- the HTML event stream ----------------------------------------------------------------


def _sse_events(text: str) -> list[tuple[str, str]]:
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in fields:
            out.append((fields["event"], fields.get("id", "")))
    return out


def test_the_html_stream_of_a_finished_job_ends_and_resumes_with_last_event_id(
    client: TestClient, cnn_onnx: Path
) -> None:
    job_id = _upload(client, cnn_onnx, {"targets": ["onnxruntime"], "name": "streamed"})
    jobs: JobStore = client.app.state.jobs  # type: ignore[attr-defined]
    jobs.fail_job(job_id, ParityFailed("made up for the test"))
    r = client.get(f"/ui/jobs/{job_id}/stream")
    events = _sse_events(r.text)
    assert [e for e, _ in events] == ["update", "finished"]
    version = events[0][1]
    assert 'data-testid="job-status"' in r.text and "PARITY_FAILED" in r.text
    again = client.get(f"/ui/jobs/{job_id}/stream", headers={"Last-Event-ID": version})
    assert [e for e, _ in _sse_events(again.text)] == ["finished"]  # nothing it already shows
    # A finished job's page does not open a stream at all.
    assert "sse-connect" not in client.get(f"/ui/jobs/{job_id}").text


# --- auth: login, session cookie, CSRF ----------------------------------------------------


@pytest.fixture(scope="module")
def auth_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, dict[str, str]]]:
    settings = _settings(tmp_path_factory.mktemp("dash-auth"), auth_enabled=True)
    app = create_app(settings, create_celery_app(settings))
    with TestClient(app) as c:
        store: TokenStore = app.state.tokens
        tokens = {
            "read": store.create_token("r", ["read"]),
            "write": store.create_token("w", ["write"]),
            "other": store.create_token("o", ["write"], "other-team"),
        }
        yield c, tokens


def _sign_in(client: TestClient, token: str) -> str:
    """Sign in through the login form; return the CSRF token the pages then carry."""
    client.cookies.clear()
    r = client.post("/ui/login", data={"token": token, "next": "/ui/"}, follow_redirects=False)
    assert r.status_code == 303, r.text
    page = client.get("/ui/")
    found = re.search(r'"X-CSRF-Token": "([0-9a-f]{64})"', page.text)
    assert found, page.text[:2000]
    return found.group(1)


def test_login_sets_a_strict_httponly_cookie_holding_a_signed_session_not_the_token(
    auth_client: tuple[TestClient, dict[str, str]],
) -> None:
    client, tokens = auth_client
    client.cookies.clear()
    r = client.get("/ui/compare?sha=ab", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login?next=%2Fui%2Fcompare%3Fsha%3Dab"
    assert client.get("/ui/static/kiln.css").status_code == 200  # static files need no session
    bad = client.post("/ui/login", data={"token": "nope", "next": "/ui/"}, follow_redirects=False)
    assert bad.status_code == 401 and "unknown or revoked" in bad.text
    ok = client.post(
        "/ui/login", data={"token": tokens["read"], "next": "https://evil.example/"}, follow_redirects=False
    )
    assert ok.status_code == 303 and ok.headers["location"] == "/ui/"  # no open redirect
    cookie = ok.headers["set-cookie"]
    assert f"{SESSION_COOKIE}=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "Secure" not in cookie  # plain http here; https gets Secure (test below)
    value = client.cookies[SESSION_COOKIE]
    assert tokens["read"] not in value and tokens["read"].split("_", 2)[2] not in value  # not the token
    session_id = client.app.state.session_keys.unsign(value)  # type: ignore[attr-defined]
    assert session_id is not None and len(session_id) >= 43  # a random id, signed
    page = client.get("/ui/")
    assert page.status_code == 200 and 'href="/ui/submit"' not in page.text  # read scope: no submit
    assert "default" in page.text  # the viewer's tenant is shown
    assert client.get("/ui/submit", follow_redirects=False).status_code in (303, 403, 404)
    # The token itself, or a session id with a forged signature, is no session.
    for forged in (tokens["read"], f"{session_id}.{'A' * 27}", value[:-2] + ("AA" if value[-2:] != "AA" else "BB")):
        client.cookies.clear()
        client.cookies.set(SESSION_COOKIE, forged)
        r = client.get("/jobs")
        assert r.status_code == 401 and r.json()["code"] == "UNAUTHORIZED", forged
        assert client.get("/ui/", follow_redirects=False).status_code == 303
    client.cookies.clear()


def test_the_api_takes_the_session_cookie_for_reads_and_exactly_the_csrf_checks_it_claims(
    auth_client: tuple[TestClient, dict[str, str]], cnn_onnx: Path
) -> None:
    client, tokens = auth_client
    bearer = {"Authorization": f"Bearer {tokens['write']}"}
    job_id = _upload(client, cnn_onnx, {"targets": ["onnxruntime"], "name": "csrf"}, headers=bearer)
    client.cookies.clear()
    assert client.get(f"/jobs/{job_id}").status_code == 401
    csrf = _sign_in(client, tokens["write"])
    assert client.get(f"/jobs/{job_id}").status_code == 200
    assert client.get(f"/jobs/{job_id}/logs").status_code == 200
    # A change with only the cookie is what a cross-site form would send: refused.
    forged = client.post(f"/jobs/{job_id}/resubmit")
    assert forged.status_code == 403 and forged.json()["code"] == "FORBIDDEN"
    assert client.post(f"/jobs/{job_id}/resubmit", headers={CSRF_HEADER: "0" * 64}).status_code == 403
    assert client.post(f"/jobs/{job_id}/resubmit", headers={CSRF_HEADER: "é".encode("latin-1") * 8}).status_code == 403
    # The API's own routes take the header only: the form field is the dashboard forms' way.
    as_field = client.post(f"/jobs/{job_id}/resubmit", data={CSRF_FIELD: csrf})
    assert as_field.status_code == 403 and CSRF_HEADER in as_field.json()["hint"]
    good = client.post(f"/jobs/{job_id}/resubmit", headers={CSRF_HEADER: csrf})
    assert good.status_code == 202, good.text
    # Another session's CSRF token is no good for this one.
    other_csrf = client.app.state.session_keys.csrf_token("another-session")  # type: ignore[attr-defined]
    assert client.post(f"/jobs/{job_id}/resubmit", headers={CSRF_HEADER: other_csrf}).status_code == 403
    # The dashboard's own form posts carry the token as a field (or the header); without it, a 403 page.
    assert client.post(f"/ui/jobs/{job_id}/cancel", data={}).status_code == 403
    assert client.post(f"/ui/jobs/{job_id}/cancel", data={CSRF_FIELD: "é" * 8}).status_code == 403
    done = client.post(f"/ui/jobs/{job_id}/cancel", data={CSRF_FIELD: csrf}, follow_redirects=False)
    assert done.status_code == 303
    assert client.get(f"/jobs/{job_id}").json()["status"] == "cancelled"
    second = client.post(f"/jobs/{job_id}/resubmit", headers={CSRF_HEADER: csrf}).json()["id"]
    header = client.post(f"/ui/jobs/{second}/cancel", headers={CSRF_HEADER: csrf}, follow_redirects=False)
    assert header.status_code == 303
    # A read session cannot cancel even with its CSRF token.
    read_csrf = _sign_in(client, tokens["read"])
    r = client.post(f"/ui/jobs/{job_id}/cancel", data={CSRF_FIELD: read_csrf})
    assert r.status_code == 403 and "FORBIDDEN" in r.text
    # Signing out ends the session at once: the same cookie reads nothing any more.
    kept = client.cookies[SESSION_COOKIE]
    out = client.post("/ui/logout", data={CSRF_FIELD: read_csrf}, follow_redirects=False)
    assert out.status_code == 303
    client.cookies.clear()
    client.cookies.set(SESSION_COOKIE, kept)
    assert client.get(f"/jobs/{job_id}").status_code == 401
    client.cookies.clear()


def test_revoking_a_token_ends_its_dashboard_sessions(auth_client: tuple[TestClient, dict[str, str]]) -> None:
    client, _ = auth_client
    tokens: TokenStore = client.app.state.tokens  # type: ignore[attr-defined]
    token = tokens.create_token("short-lived", ["read"])
    _sign_in(client, token)
    assert client.get("/jobs").status_code == 200
    tokens.revoke_token("short-lived")
    client.app.state.token_cache._items.clear()  # type: ignore[attr-defined]  # the few-second cache
    assert client.get("/jobs").status_code == 401
    client.cookies.clear()


def test_a_session_sees_only_its_tenants_jobs(auth_client: tuple[TestClient, dict[str, str]], cnn_onnx: Path) -> None:
    client, tokens = auth_client
    bearer = {"Authorization": f"Bearer {tokens['write']}"}
    mine = _upload(client, cnn_onnx, {"targets": ["onnxruntime"], "name": "default-team-model"}, headers=bearer)
    _sign_in(client, tokens["other"])
    assert client.get(f"/jobs/{mine}").status_code == 404
    assert client.get(f"/ui/jobs/{mine}").status_code == 404
    assert client.get(f"/ui/jobs/{mine}/log").status_code == 404
    assert mine not in client.get("/ui/").text
    page = client.get("/ui/")
    assert "other-team" in page.text  # the header names the viewer's tenant
    client.cookies.clear()


def test_the_cookie_is_secure_when_a_trusted_proxy_says_the_browser_used_https(tmp_path: Path) -> None:
    settings = _settings(tmp_path, auth_enabled=True, trusted_proxies="10.0.0.0/8")
    app = create_app(settings, create_celery_app(settings))
    with TestClient(app, client=("10.1.2.3", 40000)) as proxied, TestClient(app, client=("192.0.2.7", 40000)) as direct:
        token = app.state.tokens.create_token("proxied", ["read"])
        form = {"token": token, "next": "/ui/"}
        https = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "198.51.100.4"}
        via_proxy = proxied.post("/ui/login", data=form, headers=https, follow_redirects=False)
        assert via_proxy.status_code == 303 and "Secure" in via_proxy.headers["set-cookie"]
        plain = proxied.post("/ui/login", data=form, follow_redirects=False)  # the proxy says nothing: http
        assert "Secure" not in plain.headers["set-cookie"]
        # The same header from a client that is no trusted proxy is not believed.
        spoofed = direct.post("/ui/login", data=form, headers=https, follow_redirects=False)
        assert spoofed.status_code == 303 and "Secure" not in spoofed.headers["set-cookie"]
        # Behind the proxy the browser's origin is https://<host>: its own, so not refused as foreign.
        own = proxied.post(
            "/ui/login", data=form, headers={**https, "Origin": "https://testserver"}, follow_redirects=False
        )
        assert own.status_code == 303
        # An http page may not post to what the browser reached over https (a downgrade).
        downgraded = proxied.post(
            "/ui/login", data=form, headers={**https, "Origin": "http://testserver"}, follow_redirects=False
        )
        assert downgraded.status_code == 403 and downgraded.json()["code"] == "FORBIDDEN"
        ok = direct.post("/ui/login", data=form, headers={"Origin": "http://testserver"}, follow_redirects=False)
        assert ok.status_code == 303  # http page, http request: the same origin


def test_dashboard_forms_are_bounded_in_fields_and_size(auth_client: tuple[TestClient, dict[str, str]]) -> None:
    client, tokens = auth_client
    many = {f"f{i}": "x" for i in range(50)}
    r = client.post("/ui/login", data={**many, "token": tokens["read"]}, follow_redirects=False)
    assert r.status_code == 400 and r.json()["code"] == "MALFORMED_REQUEST" and "fields" in r.json()["message"]
    big = client.post("/ui/login", data={"token": "x" * (2 << 20)}, follow_redirects=False)
    assert big.status_code == 400 and big.json()["code"] == "MALFORMED_REQUEST"
    with_file = client.post("/ui/login", files={"token": ("t.txt", b"x")}, follow_redirects=False)
    assert with_file.status_code == 400


# --- bad links: 4xx pages, never a 5xx ------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/ui/?page=0&sort=sha&since=notadate&until=2026-13-45&status=lost&sha=zz",
        "/ui/?page=999999",
        "/ui/jobs/rows?precision=fp64",
        "/ui/jobs/00000000",
        "/ui/jobs/00000000/log",
        "/ui/jobs/00000000/live",
        "/ui/jobs/00000000/stream",
        "/ui/jobs/00000000/resubmit",
        "/ui/compare?sha=zz&batch=-1&min=2&latency=p75&accuracy=iou&jobs=a,b,,c",
        "/ui/compare?sha=" + "f" * 64,
        "/ui/repository/none/abc",
        "/ui/repository/none/1",
        "/ui/login?next=//evil.example",
        "/ui/static/../app.py",
    ],
)
def test_bad_links_answer_a_page_not_a_5xx(client: TestClient, path: str) -> None:
    r = client.get(path)
    assert r.status_code < 500, r.text
    assert "Traceback" not in r.text


def test_sign_in_is_throttled_per_client_after_a_few_wrong_tokens(tmp_path: Path) -> None:
    settings = _settings(tmp_path, auth_enabled=True)
    app = create_app(settings, create_celery_app(settings))
    with TestClient(app, client=("192.0.2.1", 40000)) as guesser, TestClient(app, client=("192.0.2.2", 40000)) as other:
        token = app.state.tokens.create_token("throttled", ["read"])
        for i in range(5):
            r = guesser.post("/ui/login", data={"token": f"kiln_guess_{i}", "next": "/ui/"}, follow_redirects=False)
            assert r.status_code == 401, (i, r.status_code)
        # The sixth try, even with a right token, is not looked at: 429, when to come back, no session.
        r = guesser.post("/ui/login", data={"token": token, "next": "/ui/"}, follow_redirects=False)
        assert r.status_code == 429 and 0 < int(r.headers["retry-after"]) <= 60
        assert "Too many failed sign-ins" in r.text and "set-cookie" not in r.headers
        # Another client is not held up by it.
        ok = other.post("/ui/login", data={"token": token, "next": "/ui/"}, follow_redirects=False)
        assert ok.status_code == 303


def test_the_login_throttle_forgets_failures_past_its_window_and_on_success() -> None:
    import time

    from api.login_throttle import LoginThrottle

    throttle = LoginThrottle(max_failures=2, window=0.3)
    throttle.failed("a")
    throttle.failed("a")
    assert throttle.retry_after("a") > 0 and throttle.retry_after("b") == 0
    time.sleep(0.35)
    assert throttle.retry_after("a") == 0
    throttle.failed("a")
    throttle.failed("a")
    throttle.succeeded("a")
    assert throttle.retry_after("a") == 0
