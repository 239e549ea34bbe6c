"""The web dashboard in a real browser: Debian's Chromium driven by Playwright, against a
real `kiln serve` (API + embedded worker) on a free port and a tiny CNN built in the test.

One service for the module; the tests run in file order and build on each other's jobs
(the compare view needs the jobs of the earlier tests). Waits are on DOM states, never
sleeps. Every page is screenshotted into docs/dashboard/ (the README shows them).
"""

from __future__ import annotations

import json
import re
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser_support import launch_chromium, screenshot
from jobs_support import Proc, free_port, service_env, submit, wait_http, wait_job, wait_workers

pytestmark = pytest.mark.timeout(600)

WAIT_MS = 180_000  # a live update waits for real conversions on a shared 2-core machine
FAST = {"benchmark": {"batch_sizes": [1, 2], "iterations": 5, "warmup": 1}, "validation": {"samples": 4}}

# Records every job status the page shows, to prove the page changed live (no reload).
RECORD_STATUSES = """
window.__kilnStatuses = [];
document.addEventListener("htmx:sseClose", () => { window.__kilnStreamClosed = true; });
document.addEventListener("DOMContentLoaded", () => {
  const record = () => {
    const el = document.querySelector("[data-testid=job-status]");
    if (!el) return;
    const word = el.textContent.trim().split(/\\s+/)[1];
    const seen = window.__kilnStatuses;
    if (seen[seen.length - 1] !== word) seen.push(word);
  };
  record();
  new MutationObserver(record).observe(document.body, {subtree: true, childList: true, characterData: true});
});
"""


@dataclass
class Service:
    base: str
    root: Path
    env: dict[str, str]
    proc: Proc
    jobs: dict[str, str]  # what the tests submitted, by role


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("dashboard")
    port = free_port()
    env = service_env(cache_dir=root / "cache")
    # One step at a time: a long job holds the worker, so the next one is seen queued.
    proc = Proc(
        ["serve", "--port", str(port), "--repo", str(root / "repo"), "--concurrency", "1"], env, root / "serve.log"
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/healthz", timeout=120, proc=proc)
        wait_workers(base, {"onnxruntime", "openvino"}, timeout=240, procs=[proc])
        yield Service(base, root, env, proc, {})
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with launch_chromium() as b:
        yield b


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900}, color_scheme="light")
    page = context.new_page()
    page.set_default_timeout(30_000)
    yield page
    context.close()


def _wait_step(base: str, job_id: str, step_id: str, status: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = httpx.get(f"{base}/jobs/{job_id}", timeout=5).json()
        if any(s["id"] == step_id and s["status"] == status for s in job["steps"]):
            return
        time.sleep(0.2)
    raise AssertionError(f"{step_id} of {job_id} never {status}: {json.dumps(job)[:1500]}")


def _tab_to(page: Any, selector: str, limit: int = 80) -> None:
    """Press Tab until ``selector`` has the focus: what a keyboard-only user does."""
    for _ in range(limit):
        if page.evaluate("(sel) => document.activeElement === document.querySelector(sel)", selector):
            return
        page.keyboard.press("Tab")
    raise AssertionError(f"Tab never reached {selector}")


def _choose_file_by_keyboard(page: Any, path: Path) -> None:
    """Open the focused file input's chooser with the keyboard (Space, then Enter) and pick ``path``."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for key in ("Space", "Enter", "Space"):
        try:
            with page.expect_file_chooser(timeout=10_000) as chooser:
                page.keyboard.press(key)
        except PlaywrightTimeout:
            continue  # Chromium sometimes drops the first activation of a fresh page's chooser
        chooser.value.set_files(str(path))
        return
    raise AssertionError("the file input's chooser never opened from the keyboard")


def test_submit_by_keyboard_goes_live_queued_running_succeeded(service: Service, page: Any, cnn_onnx: Path) -> None:
    from playwright.sync_api import expect

    # A long job (a huge benchmark) holds the only worker slot: the form's job must queue.
    long_spec = {
        "targets": ["onnxruntime"],
        "name": "long-job",
        "benchmark": {"batch_sizes": [64], "iterations": 100_000, "warmup": 0},  # the schema's most
        "validation": {"samples": 2},
    }
    r = submit(service.base, cnn_onnx, long_spec, params={"cache": "false"})
    assert r.status_code == 202, r.text
    service.jobs["long"] = long_id = r.json()["id"]
    _wait_step(service.base, long_id, "export:onnxruntime", "running")

    page.add_init_script(RECORD_STATUSES)
    page.goto(f"{service.base}/ui/submit")
    # Keyboard only: Tab to the file input, Space opens the chooser, Tab to the JSON, Enter submits.
    _tab_to(page, "#model")
    _choose_file_by_keyboard(page, cnn_onnx)
    preview = page.get_by_test_id("plan-preview")
    expect(preview).to_contain_text("onnxruntime: onnx → optimize ⇒ onnxruntime")
    _tab_to(page, "#advanced")
    # A longer benchmark than the other jobs', so `running` lasts long enough to be seen.
    # 20000 runs at two batch sizes keep the export step running for a second or more on an idle machine.
    spec = {"name": "tiny-fp32", **FAST, "benchmark": {"batch_sizes": [1, 2], "iterations": 20_000, "warmup": 1}}
    page.keyboard.type(json.dumps(spec))
    _tab_to(page, "#submit-button")
    screenshot(page, "submit")
    page.keyboard.press("Enter")
    page.wait_for_url(re.compile(r"/ui/jobs/[0-9a-f]{32}$"))
    job_id = page.url.rsplit("/", 1)[1]
    service.jobs["fp32"] = job_id
    status = page.get_by_test_id("job-status")
    expect(status).to_contain_text("queued")
    page.evaluate("window.__kilnMarker = 'same page'")

    # Cancel the long job from its own page (confirmation accepted).
    other = page.context.new_page()
    other.goto(f"{service.base}/ui/jobs/{long_id}")
    other.once("dialog", lambda d: d.accept())
    other.get_by_test_id("cancel").click()
    expect(other.get_by_test_id("job-status")).to_contain_text("cancelled", timeout=WAIT_MS)
    assert httpx.get(f"{service.base}/jobs/{long_id}").json()["status"] == "cancelled"
    other.close()

    # The form's job runs now; its page follows over SSE without a reload.
    expect(status).to_contain_text("succeeded", timeout=WAIT_MS)
    assert page.evaluate("window.__kilnMarker") == "same page"
    seen = page.evaluate("window.__kilnStatuses")
    assert seen[0] == "queued" and "running" in seen and seen[-1] == "succeeded", seen
    assert seen.index("running") < seen.index("succeeded")
    page.wait_for_function("window.__kilnStreamClosed === true")  # closed on `finished`: no reconnects
    row = page.locator("tr[data-target=onnxruntime]")
    for kind in ("reference", "optimize", "export", "publish"):
        assert row.locator(f"td[data-kind={kind}] .cell").get_attribute("data-status") == "succeeded"
    expect(row.locator("td[data-kind=export] .dur")).to_have_text(re.compile(r"\d+\.\d\d s"))

    # Parity against tolerances, and the benchmark chart: 2 batch sizes x (p50, p99).
    parity = page.get_by_test_id("parity")
    expect(parity).to_contain_text("cosine")
    assert page.locator("[role=meter]").count() >= 2
    bars = page.locator("[data-testid=benchmark] svg[role=img] rect.bar")
    assert bars.count() == 4
    assert float(bars.first.get_attribute("height")) > 0
    expect(page.locator("[data-testid=benchmark] svg title").first).to_contain_text("latency per batch size")

    # Download the artifact through the page's link.
    with page.expect_download() as download:
        page.get_by_test_id("download").click()
    with tarfile.open(download.value.path()) as tar:
        names = tar.getnames()
    assert any(n.endswith(".onnx") for n in names), names
    screenshot(page, "job")


def test_failing_target_shows_its_error_card(service: Service, page: Any, cnn_onnx: Path) -> None:
    from playwright.sync_api import expect

    # fp16 with zero tolerance for elementwise error and an SNR only fp32 reaches: the parity
    # check must fail, and the first node whose output fp16 rounding moves is named.
    strict = {"atol": 0, "rtol": 0, "min_snr_db": 100}
    spec = {"targets": ["onnxruntime"], "precision": "fp16", "name": "strict", "tolerances": strict}
    r = submit(service.base, cnn_onnx, {**spec, **FAST}, params={"cache": "false"})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    page.goto(f"{service.base}/ui/jobs/{job_id}")
    card = page.get_by_test_id("error-card")
    expect(card).to_contain_text("PARITY_FAILED", timeout=WAIT_MS)
    expect(page.get_by_test_id("job-status")).to_contain_text("failed")
    expect(card.get_by_role("link", name="Open the log")).to_have_attribute("href", f"/ui/jobs/{job_id}/log")
    expect(page.locator("tr.bad").first).to_be_visible()  # the output over its bound, marked in words too
    expect(card.get_by_test_id("divergent-node")).to_contain_text("First divergent node:")
    screenshot(page, "job-failed")
    page.goto(f"{service.base}/ui/jobs/{job_id}/log")
    log = page.get_by_test_id("log")
    expect(log).to_contain_text("PARITY_FAILED")
    total = int(log.get_attribute("data-total"))
    assert total > 5
    screenshot(page, "log")


def test_compare_shows_each_precision_and_the_pareto_front(service: Service, page: Any, cnn_onnx: Path) -> None:
    from playwright.sync_api import expect

    for precision in ("fp16", "int8"):
        r = submit(
            service.base,
            cnn_onnx,
            {"targets": ["onnxruntime"], "precision": precision, "name": f"tiny-{precision}", **FAST},
        )
        assert r.status_code == 202, r.text
        service.jobs[precision] = r.json()["id"]
    for precision in ("fp16", "int8"):
        assert wait_job(service.base, service.jobs[precision], timeout=WAIT_MS / 1000)["status"] == "succeeded"
    sha = httpx.get(f"{service.base}/jobs/{service.jobs['fp32']}").json()["source"]["sha256"]

    page.goto(f"{service.base}/ui/compare?sha={sha}")
    points = page.locator("[data-testid=scatter] circle.point")
    labels = sorted(points.nth(i).get_attribute("data-label") for i in range(points.count()))
    assert labels == ["onnxruntime fp16", "onnxruntime fp32", "onnxruntime int8"]
    expect(page.get_by_test_id("pareto-front")).to_have_attribute("d", re.compile(r"^M[\d.]+,[\d.]+"))
    on_front = [points.nth(i) for i in range(points.count()) if points.nth(i).get_attribute("data-front") == "true"]
    assert on_front, "no point on the Pareto front"
    expect(page.locator("svg.scatter line.tolerance")).to_have_count(1)
    expect(page.locator("svg.scatter[role=img] > title")).to_contain_text("3 points")
    screenshot(page, "compare")

    # Require more accuracy than int8 reached: its point falls below the line, greyed and off the front.
    int8_job = httpx.get(f"{service.base}/jobs/{service.jobs['int8']}").json()
    worst = min(o["cosine"] for o in int8_job["targets"]["onnxruntime"]["parity"]["outputs"])
    assert worst < 1.0
    required = worst + (1.0 - worst) / 2
    page.goto(f"{service.base}/ui/compare?sha={sha}&min={required}")
    int8 = page.locator("circle.point[data-label='onnxruntime int8']")
    expect(int8).to_have_attribute("data-passed", "false")
    expect(int8).to_have_attribute("data-front", "false")
    expect(int8).to_have_class(re.compile(r"\bfail\b"))
    expect(page.locator("circle.point[data-label='onnxruntime fp32']")).to_have_attribute("data-front", "true")
    expect(page.get_by_label("Required accuracy (tolerance line)")).to_have_value(str(required))

    # Side by side with "differences only": the precision differs, the source file does not.
    table = page.get_by_test_id("side-by-side")
    expect(table.locator("th[scope=row]", has_text=re.compile(r"^source$"))).to_have_count(1)
    page.get_by_label("Differences only").check()
    page.wait_for_url(re.compile(r"diff=1"))
    expect(table.locator("th[scope=row]", has_text=re.compile(r"^spec\.precision$"))).to_have_count(1)
    expect(table.locator("th[scope=row]", has_text=re.compile(r"^source$"))).to_have_count(0)

    # A point links to its published version, which shows the manifest and the job that made it.
    page.goto(f"{service.base}/ui/compare?sha={sha}")
    href = page.locator("a.point-link", has=page.locator("circle[data-label='onnxruntime fp32']")).get_attribute("href")
    assert re.fullmatch(r"/ui/repository/tiny-fp32/\d+", href), href
    page.goto(service.base + href)
    expect(page.get_by_test_id("manifest")).to_contain_text(sha)
    expect(page.get_by_role("link", name=service.jobs["fp32"])).to_be_visible()
    screenshot(page, "version")


def test_pages_deep_links_and_dark_mode(service: Service, browser: Any) -> None:
    from playwright.sync_api import expect

    context = browser.new_context(viewport={"width": 1280, "height": 900}, color_scheme="dark")
    page = context.new_page()
    try:
        # The list's filters live in the URL: a shared link shows the same page.
        page.goto(f"{service.base}/ui/?status=succeeded&precision=fp16&sort=name")
        rows = page.locator("table.jobs tbody tr[data-job-id]")
        expect(rows).to_have_count(1)
        assert rows.first.get_attribute("data-job-id") == service.jobs["fp16"]
        bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert bg == "rgb(21, 23, 28)", bg  # the OS asks for dark
        page.goto(f"{service.base}/ui/")
        screenshot(page, "jobs-dark")
        page.goto(f"{service.base}/ui/jobs/{service.jobs['fp32']}")
        screenshot(page, "job-dark")
        # The override beats the OS and is remembered.
        page.get_by_label("Theme").select_option("light")
        assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(255, 255, 255)"
        page.reload()
        assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(255, 255, 255)"
    finally:
        context.close()

    context = browser.new_context(viewport={"width": 1280, "height": 900}, color_scheme="light")
    page = context.new_page()
    try:
        page.goto(f"{service.base}/")
        assert page.url == f"{service.base}/ui/"
        expect(page.locator("table.jobs tbody tr[data-job-id]")).to_have_count(5)
        screenshot(page, "jobs")
        page.goto(f"{service.base}/ui/engines")
        expect(page.get_by_test_id("ready-banner")).to_contain_text("Ready")
        expect(page.locator("tr[data-engine=onnxruntime] td").nth(1)).to_have_text("1")
        screenshot(page, "engines")
        page.goto(f"{service.base}/ui/repository")
        expect(page.get_by_role("heading", name=re.compile("^tiny-fp32"))).to_be_visible()
        expect(page.locator("section", has=page.get_by_role("heading", name=re.compile("^tiny-fp32")))).to_contain_text(
            re.compile(r"[\d,]+ bytes")
        )
        # The workers signed each version and the API verified it with the same key.
        signatures = page.get_by_test_id("signature")
        expect(signatures.first).to_have_text("✓ verified")
        assert set(signatures.all_text_contents()) == {"✓ verified"}
        screenshot(page, "repository")
        # Offline API docs: Swagger UI renders from the vendored bundle.
        page.goto(f"{service.base}/docs")
        expect(page.locator(".swagger-ui .info .title")).to_contain_text("Kiln")
        # An unknown job is a page with the error's code, not a traceback.
        page.goto(f"{service.base}/ui/jobs/0000")
        expect(page.get_by_role("heading", name="NOT_FOUND")).to_be_visible()
    finally:
        context.close()


@pytest.fixture(scope="module")
def auth_service(service: Service) -> Iterator[tuple[str, dict[str, str]]]:
    """`kiln api` with auth on, over the same job store, broker and repository as `service`."""
    import subprocess

    from jobs_support import KILN_CMD, elsewhere

    env = {**service.env, "KILN_AUTH_ENABLED": "true", "KILN_REPOSITORY": str(service.root / "repo")}
    tokens = {}
    for name, scope in (("reader", "read"), ("writer", "write")):
        out = subprocess.run(
            [*KILN_CMD, "token", "create", name, "--scope", scope],
            env=env,
            cwd=elsewhere(),
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr
        tokens[name] = out.stdout.strip().splitlines()[-1]
    port = free_port()
    proc = Proc(["api", "--port", str(port), "--no-access-log"], env, service.root / "api-auth.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/healthz", timeout=120, proc=proc)
        yield base, tokens
    finally:
        proc.stop()


def test_auth_login_session_cookie_and_read_scope(
    service: Service, auth_service: tuple[str, dict[str, str]], browser: Any
) -> None:
    from playwright.sync_api import expect

    base, tokens = auth_service
    job_id = service.jobs["fp32"]
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    try:
        # No token: a deep link lands on the login page, and comes back after it.
        page.goto(f"{base}/ui/jobs/{job_id}")
        expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
        expect(page.get_by_role("link", name="Submit")).to_have_count(0)
        screenshot(page, "login")
        page.get_by_label("API token").fill("not-a-token")
        page.get_by_role("button", name="Sign in").click()
        expect(page.get_by_role("alert")).to_contain_text("unknown or revoked")
        page.get_by_label("API token").fill(tokens["reader"])
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url(f"{base}/ui/jobs/{job_id}")
        expect(page.get_by_test_id("job-status")).to_contain_text("succeeded")

        cookie = next(c for c in context.cookies() if c["name"] == "kiln_session")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and not cookie["secure"]  # http here
        assert tokens["reader"] not in cookie["value"]  # a signed session id, never the token
        expect(page.get_by_test_id("tenant")).to_contain_text("default")  # whose jobs these are
        assert page.evaluate("document.cookie") == ""  # HttpOnly: scripts cannot read it

        # Read scope: no submit, no cancel, no resubmit.
        expect(page.get_by_role("link", name="Submit")).to_have_count(0)
        expect(page.get_by_role("link", name="Resubmit…")).to_have_count(0)
        page.goto(f"{base}/ui/jobs/{service.jobs['long']}")
        expect(page.get_by_test_id("job-status")).to_contain_text("cancelled")
        expect(page.get_by_test_id("cancel")).to_have_count(0)

        # The API takes the cookie for GETs (the dashboard's fetches and streams) ...
        got = page.evaluate("(id) => fetch('/jobs/' + id).then(r => r.status)", job_id)
        assert got == 200
        # ... but not for a change without the page's CSRF token, whatever the scope.
        posted = page.evaluate(
            "(id) => fetch('/jobs/' + id + '/resubmit', {method: 'POST'}).then(r => r.json())", job_id
        )
        assert posted["code"] == "FORBIDDEN", posted
        # Without the cookie the API still wants a token.
        assert httpx.get(f"{base}/jobs/{job_id}").status_code == 401
    finally:
        context.close()

    # A write token sees the actions; its form posts carry the CSRF token.
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    try:
        page.goto(f"{base}/ui/login?next=/ui/submit")
        page.get_by_label("API token").fill(tokens["writer"])
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url(f"{base}/ui/submit")
        page.goto(f"{base}/ui/jobs/{job_id}/resubmit")
        page.get_by_role("button", name="Resubmit").click()
        page.wait_for_url(re.compile(r"/ui/jobs/[0-9a-f]{32}$"))
        new_id = page.url.rsplit("/", 1)[1]
        assert new_id != job_id
        expect(page.get_by_test_id("job-status")).to_contain_text("succeeded", timeout=WAIT_MS)
        job = httpx.get(f"{base}/jobs/{new_id}", headers={"Authorization": f"Bearer {tokens['writer']}"}).json()
        assert (
            job["source"]["sha256"]
            == httpx.get(f"{base}/jobs/{job_id}", headers={"Authorization": f"Bearer {tokens['writer']}"}).json()[
                "source"
            ]["sha256"]
        )
        assert any(s["cached"] for s in job["steps"])  # the cache makes a resubmission quick
    finally:
        context.close()


def test_a_step_without_a_worker_says_why_it_waits(service: Service, page: Any, cnn_onnx: Path) -> None:
    from playwright.sync_api import expect

    # The submit form's plan preview warns before anything is uploaded ...
    page.goto(f"{service.base}/ui/submit")
    page.set_input_files("#model", str(cnn_onnx))
    page.get_by_role("checkbox", name="tensorrt", exact=True).check()
    expect(page.get_by_test_id("no-worker-warning")).to_contain_text("tensorrt-cu13")

    # ... the jobs list, left open, shows the new job without a reload ...
    page.goto(f"{service.base}/ui/")
    page.evaluate("window.__kilnMarker = 'same page'")
    # No worker serves TensorRT here: such a job is accepted only when it asks to wait for one.
    r = submit(service.base, cnn_onnx, {"targets": ["tensorrt"], "name": "no-gpu", "wait_for_workers": True, **FAST})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    try:
        expect(page.locator(f"tr[data-job-id='{job_id}']")).to_contain_text("no-gpu", timeout=30_000)
        assert page.evaluate("window.__kilnMarker") == "same page"
        # ... and the job, which needs that engine, shows on its queued step why it waits.
        page.goto(f"{service.base}/ui/jobs/{job_id}")
        export = page.locator("tr[data-target=tensorrt] td[data-kind=export] .cell")
        expect(export).to_have_attribute("data-status", "queued", timeout=WAIT_MS)
        expect(export.locator(".waiting")).to_contain_text("no live worker serves tensorrt-cu13")
        page.goto(f"{service.base}/ui/engines")
        row = page.locator("tr[data-engine=tensorrt-cu13]")
        expect(row.locator(".waiting")).to_contain_text("no live worker")
        expect(row.locator("td").nth(2)).to_contain_text("1")
    finally:
        httpx.delete(f"{service.base}/jobs/{job_id}")


def test_a_refused_upload_shows_its_error_code_and_hint(service: Service, page: Any, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    notes = tmp_path / "notes.onnx"
    notes.write_text("not a model at all")
    before = httpx.get(f"{service.base}/jobs", params={"limit": 1}).json()["count"]
    page.goto(f"{service.base}/ui/submit")
    page.set_input_files("#model", str(notes))
    expect(page.get_by_test_id("plan-preview")).to_contain_text("onnxruntime: onnx")
    page.get_by_role("button", name="Submit").click()
    card = page.get_by_test_id("form-error")
    expect(card).to_contain_text(re.compile(r"SOURCE_UNREADABLE|UNSUPPORTED_FORMAT"))
    expect(card.locator(".hint")).not_to_be_empty()
    assert page.url.endswith("/ui/submit")
    assert httpx.get(f"{service.base}/jobs", params={"limit": 1}).json()["count"] == before


# Snapshots of a tune job's section each time the page changes: its phase line, its candidate
# rows and whether a recommendation shows, to prove candidates arrive live (no reload).
RECORD_TUNE = """
window.__kilnTune = [];
document.addEventListener("DOMContentLoaded", () => {
  const record = () => {
    const section = document.querySelector("[data-testid=tune]");
    if (!section) return;
    const phase = section.querySelector("[data-testid=tune-phase]").textContent.trim();
    const rows = section.querySelectorAll("[data-testid=tune-candidates] tbody tr").length;
    const rec = !!section.querySelector("[data-testid=tune-recommendation]");
    const seen = window.__kilnTune, last = seen[seen.length - 1];
    if (!last || last.phase !== phase || last.rows !== rows || last.rec !== rec) seen.push({phase, rows, rec});
  };
  record();
  new MutationObserver(record).observe(document.body, {subtree: true, childList: true, characterData: true});
});
"""


def test_the_tune_page_starts_a_tune_whose_candidates_arrive_live(service: Service, page: Any, cnn_onnx: Path) -> None:
    from playwright.sync_api import expect

    wait_workers(service.base, {"tune"}, timeout=60, procs=[service.proc])
    page.add_init_script(RECORD_TUNE)
    page.goto(f"{service.base}/ui/tune")
    page.set_input_files("#model", str(cnn_onnx))
    for target in ("onnxruntime", "openvino", "tflite", "tvm", "mnn", "ncnn"):
        box = page.locator(f"#tune-targets input[value={target}]")
        if box.count():
            box.set_checked(target in ("onnxruntime", "openvino"))
    page.locator("#tune-precisions input[value=fp16]").set_checked(False)
    page.fill("#rounds", "200")
    page.fill("#name", "tiny-tuned")
    page.fill("#spec", json.dumps({"validation": {"samples": 4}}))
    screenshot(page, "tune")
    page.get_by_role("button", name="Start tune").click()
    page.wait_for_url(re.compile(r"/ui/jobs/[0-9a-f]{32}$"))
    job_id = page.url.rsplit("/", 1)[1]

    rec = page.get_by_test_id("tune-recommendation")
    expect(rec).to_be_visible(timeout=WAIT_MS)
    expect(page.get_by_test_id("job-status")).to_contain_text("succeeded", timeout=WAIT_MS)
    seen = page.evaluate("window.__kilnTune")
    live = [s for s in seen if not s["rec"]]
    assert live, f"the page never showed the search before its recommendation: {seen}"
    assert any(s["rows"] for s in live), f"no candidate row arrived before the recommendation: {seen}"
    assert len({s["phase"] for s in seen}) >= 3, seen  # it moved through the search's phases
    assert seen[-1]["rec"] and seen[-1]["phase"] == "done", seen

    # The page shows what the API reports: every candidate, the recommendation and its Pareto point.
    job = httpx.get(f"{service.base}/jobs/{job_id}").json()
    report = job["tune"]
    rows = page.locator("[data-testid=tune-candidates] tbody tr")
    expect(rows).to_have_count(len(report["candidates"]))
    chosen = report["recommendation"]
    assert rows.first.get_attribute("data-candidate") == chosen["id"]
    assert rows.first.get_attribute("data-recommended") == "true"
    expect(page.get_by_test_id("tune-rec-p50")).to_have_text(f"{chosen['p50_ms']:.3f}")
    point = page.locator("[data-testid=tune-pareto] circle[data-recommended=true]")
    expect(point).to_have_count(1)
    assert abs(float(point.get_attribute("data-p50")) - chosen["p50_ms"]) < 1e-9
    assert point.get_attribute("data-front") == "true"
    timed = [c for c in report["candidates"] if c["p50_ms"] is not None]
    expect(page.locator("[data-testid=tune-pareto] circle.point")).to_have_count(len(timed))

    # The recommendation's per-layer profile: one bar per operator type, longest first.
    bars = page.locator("[data-testid=tune-profile] rect[data-op]")
    ops = chosen["profile"]["top_ops"]
    expect(bars).to_have_count(min(len(ops), 10))
    widths = [float(bars.nth(i).get_attribute("width")) for i in range(bars.count())]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]
    assert bars.first.get_attribute("data-op") == max(ops, key=lambda o: o["ms_per_run"])["op_type"]
    # Both engines' profiles are on the page (the other ones folded): OpenVINO's with the precision it ran in.
    page.evaluate("document.querySelectorAll('[data-testid=tune] details').forEach((d) => { d.open = true; })")
    captions = page.locator("[data-testid=tune] figure.profile figcaption")
    expect(captions.filter(has_text="onnxruntime/")).not_to_have_count(0)
    expect(captions.filter(has_text="openvino/").first).to_contain_text("executed in")
    screenshot(page, "tune-job")


def test_the_form_uploads_whole_feed_calibration_for_a_state_and_a_scalar(
    service: Service, page: Any, tmp_path: Path
) -> None:
    """Issue 19: a model with ``state [2, B, 16]`` (batch on axis 1) and a 0-d int64 ``sr``, and an
    .npz of whole feeds keyed ``<sample>/<input>`` chosen in the form's calibration field."""
    import numpy as np
    from playwright.sync_api import expect

    from kiln_testing.models import stateful_scalar_feeds, stateful_scalar_onnx

    model = stateful_scalar_onnx(tmp_path / "stateful.onnx")
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, **stateful_scalar_feeds(8))
    page.goto(f"{service.base}/ui/submit")
    page.set_input_files("#model", str(model))
    page.set_input_files("#calibration", str(feeds))
    expect(page.get_by_test_id("plan-preview")).to_contain_text("onnxruntime: onnx")
    page.fill("#advanced", json.dumps({"name": "stateful-form", "benchmark": False}))
    page.get_by_role("button", name="Submit").click()
    page.wait_for_url(re.compile(r"/ui/jobs/[0-9a-f]{32}$"))
    job_id = page.url.rsplit("/", 1)[1]
    expect(page.get_by_test_id("job-status")).to_contain_text("succeeded", timeout=WAIT_MS)
    expect(page.get_by_test_id("input-provenance").first).to_contain_text("whole feeds of the calibration file")
    job = httpx.get(f"{service.base}/jobs/{job_id}").json()
    assert job["spec"]["calibration"] == "feeds.npz" and job["source"]["filename"] == "stateful.onnx"
    parity = job["targets"]["onnxruntime"]["parity"]
    assert parity["passed"] and parity["inputs_from"] == "calibration", parity
    assert parity["shapes"][0] == {"x": [1, 8], "state": [2, 1, 16], "sr": []}, parity["shapes"]
    whole = "whole feeds of the calibration file"
    provenance = dict(parity["input_provenance"])
    assert "2 of the file's 8 rows are held out" in provenance.pop("held out"), parity  # and it says so
    assert "mixed with another" in provenance.pop("synthesized"), parity  # 6 more made from the feeds
    assert provenance == {"x": whole, "state": whole, "sr": whole}, parity


def test_the_form_uploads_labelled_data_and_the_job_page_scores_it(
    service: Service, page: Any, tmp_path: Path, cnn_onnx: Path
) -> None:
    """Issue 28's evaluation from the form: the labelled .npz is a file field, uploaded as the
    `evaluation` part, and the section's defaults (metric top1) alone never make a section the
    server refuses (before, every submit sent evaluation.metric without data: INVALID_SPEC)."""
    import numpy as np
    import onnxruntime as ort
    from playwright.sync_api import expect

    x = np.random.default_rng(3).standard_normal((16, 3, 32, 32)).astype(np.float32)
    sess = ort.InferenceSession(str(cnn_onnx), providers=["CPUExecutionProvider"])
    labels = sess.run(None, {"input": x})[0].argmax(axis=1)
    data = tmp_path / "labelled.npz"
    np.savez(data, input=x, labels=labels)

    # The plan preview first: it asked /plan with the section's default metric alone, which refused it.
    page.goto(f"{service.base}/ui/submit")
    page.set_input_files("#model", str(cnn_onnx))
    expect(page.get_by_test_id("plan-preview")).to_contain_text("onnxruntime: onnx")

    page.get_by_text("More options").click()
    page.set_input_files("#evaluation", str(data))
    page.fill("#spec-evaluation-max_drop", "0.05")
    page.fill("#advanced", json.dumps({"name": "evaluated-form", "benchmark": False}))
    page.get_by_role("button", name="Submit").click()
    page.wait_for_url(re.compile(r"/ui/jobs/[0-9a-f]{32}$"))
    job_id = page.url.rsplit("/", 1)[1]
    expect(page.get_by_test_id("job-status")).to_contain_text("succeeded", timeout=WAIT_MS)
    job = httpx.get(f"{service.base}/jobs/{job_id}").json()
    assert job["spec"]["evaluation"]["data"] == "labelled.npz", job["spec"]
    assert job["spec"]["evaluation"]["max_drop"] == 0.05
    evaluation = job["targets"]["onnxruntime"]["evaluation"]
    # Labels are the source's own predictions: the source scores 1.0 on them.
    assert evaluation["source"] == 1.0 and evaluation["passed"] is True, evaluation
    expect(page.get_by_test_id("evaluation-source").first).to_have_text("1.0000")
    expect(page.get_by_test_id("evaluation-artifact").first).to_contain_text("1.0000")
