"""Webhooks (the spec's notify) from a real `kiln serve` to a receiver on loopback, which the operator allows explicitly.

The receiver answers as scripted (500 then 200, say); the test checks each POST's signature
with its own HMAC code, the body (the job's summary), the retries and the job's events, and
that neither a failing receiver nor an unreachable one holds the job up.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from jobs_support import Proc, free_port, service_env, submit, wait_http
from kiln_client import Client, KilnError, verify_webhook

from services.errors import InvalidSpec
from services.webhooks import check_url

SECRET = "s3cret-webhook-key-0123456789"
SPEC: dict[str, Any] = {"targets": ["onnxruntime"], "benchmark": False, "validation": {"samples": 2}}


class Receiver:
    """An HTTP server on loopback that records each POST and answers the next scripted status."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = list(statuses)
        self.posts: list[dict[str, Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts.append({"headers": dict(self.headers), "body": body, "at": time.time()})
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/kiln?team=a"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, n: int, timeout: float = 60) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.posts) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.posts) >= n, self.posts
        return self.posts

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("webhooks")
    port = free_port()
    env = service_env(
        cache_dir=root / "cache",
        webhook_allow_networks="127.0.0.1/32",  # the receiver's loopback address, and nothing else
        webhook_retry_seconds=0.2,
        webhook_attempts=3,
    )
    proc = Proc(["serve", "--port", str(port), "--repo", str(root / "repo")], env, root / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", proc=proc)
        yield url
    finally:
        proc.stop()


def _signed_right(post: dict[str, Any], secret: str) -> bool:
    headers = {k.lower(): v for k, v in post["headers"].items()}
    mac = hmac.new(secret.encode(), headers["x-kiln-timestamp"].encode() + b"." + post["body"], hashlib.sha256)
    return hmac.compare_digest("sha256=" + mac.hexdigest(), headers["x-kiln-signature"])


def _events(base: str, job_id: str) -> list[str]:
    log = httpx.get(f"{base}/jobs/{job_id}/logs").text
    return [line.split()[1] for line in log.splitlines()[1:] if line and not line.startswith("---")]


def test_a_webhook_is_signed_retried_and_recorded(server: str, cnn_onnx: Path) -> None:
    receiver = Receiver([500, 200])
    try:
        notify = {"url": receiver.url, "events": ["succeeded"], "secret": SECRET}
        with Client(server) as kiln:
            job = kiln.compile(cnn_onnx, {**SPEC, "notify": notify}, timeout=120)
            assert job.ok
            first, second = receiver.wait_for(2)
            for n, post in enumerate((first, second), start=1):
                headers = {k.lower(): v for k, v in post["headers"].items()}
                assert _signed_right(post, SECRET)
                assert not _signed_right(post, SECRET + "x")
                assert verify_webhook(SECRET, post["headers"], post["body"])  # the client's helper agrees
                assert not verify_webhook(SECRET, post["headers"], post["body"] + b" ")
                assert abs(int(headers["x-kiln-timestamp"]) - post["at"]) < 60
                assert headers["x-kiln-event"] == "succeeded" and headers["x-kiln-job"] == job.id
                assert headers["x-kiln-attempt"] == str(n) and headers["content-type"] == "application/json"
            body = json.loads(second["body"])
            assert body["id"] == job.id and body["status"] == "succeeded" and body["url"] == f"/jobs/{job.id}"
            target = body["targets"]["onnxruntime"]
            assert target["status"] == "succeeded" and target["parity_passed"] is True
            assert target["published"]["version"] >= 1 and body["source"]["filename"] == "cnn.onnx"
            deadline = time.monotonic() + 10  # the delivery is recorded just after the answer
            while "webhook_delivered" not in _events(server, job.id) and time.monotonic() < deadline:
                time.sleep(0.1)
            events = _events(server, job.id)
            # Recorded after the job ended: the webhook never held it up.
            assert events.index("finished") < events.index("webhook_failed") < events.index("webhook_delivered")
            # The secret is in no answer: the job's spec shows where it posts, not how it signs.
            shown = httpx.get(f"{server}/jobs/{job.id}").text + httpx.get(f"{server}/jobs/{job.id}/logs").text
            assert SECRET not in shown
            assert kiln.job(job.id).spec["notify"] == {"url": receiver.url, "events": ["succeeded"]}
            assert "team=a" not in httpx.get(f"{server}/jobs/{job.id}/logs").text  # events name the origin only
            # A resubmission to the same URL keeps the secret (the stored spec has none).
            again = kiln.resubmit(job.id, wait=True, timeout=120)
            third = receiver.wait_for(3)[2]
            assert json.loads(third["body"])["id"] == again.id and _signed_right(third, SECRET)
    finally:
        receiver.close()


def test_a_receiver_that_is_down_never_holds_the_job_up(server: str, cnn_onnx: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens there
    with Client(server) as kiln:
        job = kiln.compile(cnn_onnx, {**SPEC, "notify": {"url": down, "secret": SECRET}}, timeout=120)
        assert job.ok
        deadline = time.monotonic() + 30
        while "webhook_gave_up" not in _events(server, job.id) and time.monotonic() < deadline:
            time.sleep(0.1)
        events = _events(server, job.id)
        assert events.count("webhook_failed") == 2 and events[-1] == "webhook_gave_up"  # 3 attempts
        assert events.index("finished") < events.index("webhook_failed")


def test_internal_addresses_and_missing_secrets_are_refused_at_submit(server: str, cnn_onnx: Path) -> None:
    for url in ("http://169.254.169.254/latest/meta-data", "http://10.0.0.7/hook", "http://[::1]:9/hook"):
        r = submit(server, cnn_onnx, {**SPEC, "notify": {"url": url, "secret": SECRET}})
        assert r.status_code == 422, r.text
        body = r.json()
        assert body["code"] == "INVALID_SPEC" and body["details"]["errors"][0]["field"] == "notify.url"
        assert "KILN_WEBHOOK_ALLOW_NETWORKS" in body["hint"]
    with Client(server) as kiln, pytest.raises(KilnError) as no_secret:
        kiln.compile(cnn_onnx, {**SPEC, "notify": {"url": "http://127.0.0.1:9/hook"}})
    assert no_secret.value.code == "INVALID_SPEC" and no_secret.value.details["errors"][0]["field"] == "notify.secret"
    short = submit(server, cnn_onnx, {**SPEC, "notify": {"url": "http://127.0.0.1:9/", "secret": "short"}})
    assert short.status_code == 422 and "notify.secret" in short.text


@pytest.mark.parametrize(
    "url",
    ["http://localhost/hook", "http://127.0.0.2:8080/", "http://[::1]/", "http://0x7f000001/", "http://192.168.1.9/"],
)
def test_the_outbound_check_refuses_the_service_s_own_networks(url: str) -> None:
    with pytest.raises(InvalidSpec):
        check_url(url)
    check_url(url, ["127.0.0.0/8", "::1/128", "192.168.0.0/16"])  # allowed explicitly


@pytest.mark.parametrize(
    ("address", "inside"),
    [
        ("::7f00:1", "127.0.0.1"),  # IPv4-compatible
        ("::ffff:127.0.0.1", "127.0.0.1"),  # IPv4-mapped
        ("64:ff9b::a9fe:a9fe", "169.254.169.254"),  # NAT64: the metadata endpoint through a gateway
        ("64:ff9b::a00:7", "10.0.0.7"),
        ("2002:7f00:1::", "127.0.0.1"),  # 6to4
        ("2002:a9fe:a9fe::1", "169.254.169.254"),
    ],
)
def test_ipv6_forms_that_embed_an_internal_ipv4_address_are_refused(address: str, inside: str) -> None:
    """Python's is_global says yes to all of these but the mapped form: the IPv4 inside decides."""
    import ipaddress

    from services.webhooks import embedded_ipv4, internal_address

    addr = ipaddress.ip_address(address)
    assert ipaddress.ip_address(inside) in embedded_ipv4(addr)  # type: ignore[arg-type]
    assert internal_address(addr)
    with pytest.raises(InvalidSpec) as info:
        check_url(f"http://[{address}]:8080/hook")
    assert "loopback, link-local or private" in info.value.message


def test_ipv6_forms_of_a_public_ipv4_address_and_plain_public_ipv6_pass() -> None:
    import ipaddress

    from services.webhooks import internal_address

    for address in ("64:ff9b::808:808", "2002:808:808::1", "2606:4700:4700::1111", "8.8.8.8"):
        assert not internal_address(ipaddress.ip_address(address)), address
    assert internal_address(ipaddress.ip_address("64:ff9b:1::808:808"))  # local-use NAT64: the operator's
