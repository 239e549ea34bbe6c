"""A client generated from the live OpenAPI document drives a real `kiln serve`: submit → job → download.

openapi-python-client (a maintained generator) runs on the server's own /openapi.json and
writes a package to a temporary folder, which this test imports and uses as any team would:
the multipart upload, the Idempotency-Key header, bearer auth, typed answers and errors, the
event stream and the tar download. The generator cannot share Kiln's virtualenv (it pins
typer<0.28), so `make openapi-client-venv` builds one for it (the Makefile's
OPENAPI_CLIENT_VENV); KILN_TEST_OPENAPI_CLIENT_PYTHON points at another interpreter with it.
Without one the tests skip, saying so.

The one generator setting beyond names: it decodes only JSON, text and
``application/octet-stream`` bodies, so ``application/x-tar`` (what the download really is)
is read as bytes through its documented ``content_type_overrides``. The event stream needs
none: the generated call returns the stream's text once the job ends, and each event's
``data`` parses into the generated model its ``type`` names in the document.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import subprocess
import sys
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import onnx
import pytest
import schemathesis
from jobs_support import Proc, free_port, service_env, tool_python, wait_http
from schemathesis.checks import content_type_conformance, response_schema_conformance, status_code_conformance

TOKEN = "kiln_0a11ce00_" + "q" * 43
PACKAGE = "kiln_openapi_client"
SPEC = {"targets": ["onnxruntime"], "benchmark": False, "validation": {"samples": 2}}
GENERATOR_CONFIG = {
    "project_name_override": "kiln-openapi-client",
    "package_name_override": PACKAGE,
    "content_type_overrides": {"application/x-tar": "application/octet-stream"},
}


@pytest.fixture(scope="module")
def generator() -> Path:
    python = tool_python(
        "KILN_TEST_OPENAPI_CLIENT_PYTHON", "OPENAPI_CLIENT_VENV", "openapi-client-venv", "openapi-python-client"
    )
    return python.parent / "openapi-python-client"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`kiln serve` with auth on, so the generated client's bearer auth is exercised too."""
    root = tmp_path_factory.mktemp("openapi-serve")
    port = free_port()
    proc = Proc(
        ["serve", "--port", str(port), "--repo", str(root / "repo")],
        service_env(cache_dir=root / "cache", auth_enabled="true", admin_token=TOKEN),
        root / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", proc=proc)
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def document(server: str) -> dict[str, Any]:
    answer = httpx.get(f"{server}/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def generated(
    generator: Path, document: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ModuleType]:
    """The generated package, imported from a temporary folder (never committed)."""
    out = tmp_path_factory.mktemp("generated")
    (out / "openapi.json").write_text(json.dumps(document))
    (out / "config.json").write_text(json.dumps(GENERATOR_CONFIG))
    done = subprocess.run(
        [str(generator), "generate", "--path", "openapi.json", "--config", "config.json", "--meta", "none"],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=120,
        # Its post-hook formats the package with the ruff of its own venv.
        env={**os.environ, "PATH": f"{generator.parent}{os.pathsep}{os.environ.get('PATH', '')}"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # A part of the document it could not turn into code is a warning, not a failure: none is allowed.
    assert "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(out))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(f"{PACKAGE}.")]:
            del sys.modules[name]


def _part(name: str) -> Any:
    """Return a module of the generated package (``models``, ``types``, ``api.jobs.submit``...)."""
    return importlib.import_module(f"{PACKAGE}.{name}")


def _parse_sse(text: str) -> list[dict[str, str]]:
    """Return the stream's events as {id, event, data} (blocks without data are no events)."""
    events = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if line and not line.startswith(":"):
                key, _, value = line.partition(":")
                fields[key] = value.removeprefix(" ")
        if "data" in fields:
            events.append(fields)
    return events


def _event_classes(document: dict[str, Any]) -> dict[str, type]:
    """Return the generated model of each event type, by the document's discriminator mapping."""
    mapping = document["components"]["schemas"]["JobEventPublic"]["discriminator"]["mapping"]
    return {kind: getattr(_part("models"), ref.rsplit("/", 1)[-1]) for kind, ref in mapping.items()}


def test_a_generated_client_submits_waits_and_downloads(
    generated: ModuleType, document: dict[str, Any], server: str, cnn_onnx: Path
) -> None:
    models, types = _part("models"), _part("types")
    submit, job_events, get_job = _part("api.jobs.submit"), _part("api.jobs.job_events"), _part("api.jobs.get_job")
    download_artifact = _part("api.jobs.download_artifact")
    client = generated.AuthenticatedClient(base_url=server, token=TOKEN, timeout=httpx.Timeout(120.0))
    key = str(uuid.uuid4())

    def upload() -> Any:
        return models.JobCreate(
            model=types.File(payload=io.BytesIO(cnn_onnx.read_bytes()), file_name=cnn_onnx.name),
            spec=models.CompileSpec.from_dict(SPEC),
        )

    with client:
        # Submit: the multipart body as the document describes it, with an idempotency key.
        sent = submit.sync_detailed(client=client, body=upload(), idempotency_key=key)
        assert sent.status_code == 202, sent.content
        accepted = sent.parsed
        assert isinstance(accepted, models.JobAccepted) and accepted.url == f"/jobs/{accepted.id}"
        assert sent.headers["location"] == accepted.url
        again = submit.sync_detailed(client=client, body=upload(), idempotency_key=key)
        assert again.status_code == 200 and again.parsed.id == accepted.id
        assert again.headers["idempotent-replayed"] == "true"

        # Wait: the event stream ends with the job; each event parses into its generated model.
        stream = job_events.sync_detailed(accepted.id, client=client)
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        classes = _event_classes(document)
        events = []
        for raw in _parse_sse(stream.content.decode()):
            event = classes[raw["event"]].from_dict(json.loads(raw["data"]))
            assert event.type_ == raw["event"]
            events.append((int(raw["id"]), event))
        assert [i for i, _ in events] == sorted({i for i, _ in events})
        assert isinstance(events[0][1], models.JobSubmittedEvent) and events[0][1].filename == cnn_onnx.name
        last = events[-1][1]
        assert isinstance(last, models.JobFinishedEvent) and last.status.value == "succeeded" and last.ok is True
        finished_steps = {e.step: e.seconds for _, e in events if isinstance(e, models.StepFinishedEvent)}
        assert {"reference", "export:onnxruntime", "publish:onnxruntime"} <= set(finished_steps)
        assert all(isinstance(s, float) and s >= 0 for s in finished_steps.values())

        # The job, typed.
        job = get_job.sync(accepted.id, client=client)
        assert isinstance(job, models.JobPublic) and job.status.value == "succeeded"
        target = job.targets["onnxruntime"]
        assert target.status.value == "succeeded" and target.download_url == f"/jobs/{job.id}/artifacts/onnxruntime"
        assert job.source.sha256 == events[0][1].sha256

        # Download: a tar of the published files, with the compiled model in it.
        artifact = download_artifact.sync(accepted.id, "onnxruntime", client=client)
        assert isinstance(artifact, types.File)
        with tarfile.open(fileobj=io.BytesIO(artifact.payload.read())) as tar:
            members = {m.name: tar.extractfile(m) for m in tar.getmembers() if m.isfile()}
            [name] = [n for n in members if n.endswith("/model.onnx")]
            compiled = onnx.load_model_from_string(members[name].read())  # type: ignore[union-attr]
        source = onnx.load(cnn_onnx)
        assert [i.name for i in compiled.graph.input] == [i.name for i in source.graph.input]
        assert [o.name for o in compiled.graph.output] == [o.name for o in source.graph.output]


def test_a_generated_client_gets_typed_errors(generated: ModuleType, server: str) -> None:
    models = _part("models")
    get_job, list_jobs = _part("api.jobs.get_job"), _part("api.jobs.list_jobs")
    with generated.AuthenticatedClient(base_url=server, token=TOKEN) as client:
        missing = get_job.sync_detailed("no-such-job", client=client)
        assert missing.status_code == 404
        assert isinstance(missing.parsed, models.ErrorPublic) and missing.parsed.code == "NOT_FOUND"
        invalid = list_jobs.sync_detailed(client=client, limit=0)  # limit is 1..500
        assert invalid.status_code == 422
        assert isinstance(invalid.parsed, models.ErrorPublic) and invalid.parsed.code == "INVALID_SPEC"
        assert "limit" in invalid.parsed.message
    with generated.Client(base_url=server) as anonymous:
        refused = get_job.sync_detailed("no-such-job", client=anonymous)  # type: ignore[arg-type]
        assert refused.status_code == 401
        assert isinstance(refused.parsed, models.ErrorPublic) and refused.parsed.code == "UNAUTHORIZED"


def test_the_live_servers_event_stream_matches_its_document(server: str, cnn_onnx: Path) -> None:
    """schemathesis reads a real job's stream from the real server and validates every event."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with cnn_onnx.open("rb") as fh:
        files = {"model": (cnn_onnx.name, fh), "spec": (None, json.dumps(SPEC), "application/json")}
        job_id = httpx.post(f"{server}/compile", files=files, headers=auth, timeout=60).json()["id"]
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json", headers=auth)
    schema.config.max_stream_events = 1000  # the whole stream, not its first 20 events
    case = schema["/jobs/{job_id}/events"]["GET"].Case(path_parameters={"job_id": job_id}, headers=auth)
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
    response = case.call_and_validate(base_url=server, checks=checks, timeout=120)
    kinds = [line.removeprefix("event: ") for line in response.text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "submitted" and kinds[-1] == "finished" and "step_finished" in kinds
