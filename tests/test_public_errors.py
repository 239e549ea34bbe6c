"""A failed step's error, as the API shows it (GET /jobs/{id}, GET /jobs, SSE events), carries a
code, a message, a hint and a short excerpt: never a traceback or a host path. The tool's
full output stays in GET /jobs/{id}/logs for operators.

The errors are real: steps run in a real step child (a Python exception with a host path in
it, a segfault), and the job store records them as a worker does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from jobs_support import REPO_ROOT, TESTS_DIR, redis_url

from api.app import create_app
from services.graph.planner import PlanStep
from services.public_errors import excerpt, public_error, sanitise_text
from services.settings import Settings
from services.storage import LocalArtifactStore
from workers.app import create_celery_app
from workers.child import StepRequest, run_in_child

os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH")) if p)

#: What must never reach a user: traceback furniture and paths of this machine.
LEAKS = re.compile(r"Traceback|File \"|\.py\"|line \d+, in|/work/|/tmp/|/root/|/home/|site-packages")


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Settings]]:
    root = tmp_path_factory.mktemp("public-errors")
    settings = Settings(
        cache_dir=root / "cache",
        repository=str(root / "repo"),
        artifact_store=str(root / "store"),
        broker_url=redis_url(14),
    )
    with TestClient(create_app(settings, create_celery_app(settings))) as c:
        yield c, settings


def _child_error(settings: Settings, cnn_onnx: Path, entry: str, name: str) -> tuple[dict[str, Any], str]:
    """Run ``entry`` in a real step child; return its error and its log as a worker gets them."""
    store = LocalArtifactStore(Path(settings.store_location))
    upload = settings.cache_dir / f"upload-{name}"
    upload.mkdir(parents=True)
    shutil.copy(cnn_onnx, upload / "cnn.onnx")
    store.put_dir(f"sources/{name}", upload)
    step = PlanStep(id="convert", kind="convert", engine="onnxruntime", entry=f"jobs_support:{entry}", tool="tool")
    req = StepRequest(
        job_id=name,
        step=step.to_dict(),
        spec={"targets": ["onnxruntime"], "benchmark": False},
        source_key=f"sources/{name}",
        source_filename="cnn.onnx",
        input_keys={},
        settings=settings,
        scratch=settings.cache_dir / "scratch" / name,
        use_cache=False,
    )
    res = run_in_child(req, soft_limit=60, hard_limit=90)
    assert not res.ok and res.error
    return res.error, res.log


def _fail_first_step(client: TestClient, cnn_onnx: Path, error: dict[str, Any], log: str) -> str:
    files = {
        "model": ("cnn.onnx", cnn_onnx.read_bytes()),
        "spec": (None, '{"targets": ["onnxruntime"], "wait_for_workers": true}'),
    }
    r = client.post("/compile", files=files, params={"cache": "false"})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    steps = client.app.state.steps  # type: ignore[attr-defined]
    first = client.get(f"/jobs/{job_id}").json()["steps"][0]["id"]
    claimed = steps.claim_step(job_id, first, "test-worker", 60.0)
    assert claimed is not None
    steps.finish_step(job_id, first, claimed.attempt, status="failed", seconds=0.1, error=error, log=log)
    return str(job_id)


@pytest.mark.parametrize(
    ("entry", "code", "says"),
    [
        ("path_raising_step", "CONVERSION_FAILED", "ValueError: cannot parse cnn.onnx: unexpected end of data"),
        ("raising_step", "CONVERSION_FAILED", "RuntimeError: the converter could not handle op FancyOp"),
        ("segfault_step", "CONVERSION_FAILED", "SIGSEGV"),
    ],
)
def test_a_failed_steps_error_shows_code_message_hint_and_excerpt_never_a_traceback_or_host_path(
    api: tuple[TestClient, Settings], cnn_onnx: Path, entry: str, code: str, says: str
) -> None:
    client, settings = api
    error, log = _child_error(settings, cnn_onnx, entry, entry.replace("_", "-"))
    assert LEAKS.search(json.dumps(error))  # what the child reports does carry them...
    job_id = _fail_first_step(client, cnn_onnx, error, log)

    job = client.get(f"/jobs/{job_id}").json()
    listing = client.get("/jobs").json()
    with client.stream("GET", f"/jobs/{job_id}/events") as r:
        events = "".join(r.iter_text())
    for shown in (json.dumps(job), json.dumps(listing), events):
        assert not LEAKS.search(shown), LEAKS.search(shown)  # ...what users see does not
    assert job["status"] == "failed"
    step = job["steps"][0]
    assert step["error"]["code"] == code and step["error"]["hint"]
    assert says in step["error"]["message"] + step["error"]["details"].get("excerpt", "")
    assert "output_tail" not in step["error"]["details"]
    assert 0 < len(step["error"]["details"].get("excerpt", "x")) <= 600
    target = job["targets"]["onnxruntime"]
    assert target["error"]["code"] == code and not LEAKS.search(json.dumps(target))

    logs = client.get(f"/jobs/{job_id}/logs").text  # the operators' view keeps the tool's output
    if entry != "segfault_step":
        assert "Traceback (most recent call last)" in logs and says.split(":")[0] in logs
    else:
        assert "Segmentation fault" in logs


def test_the_excerpt_keeps_the_tools_last_words_and_drops_frames_and_paths() -> None:
    output = (
        "converting graph\n"
        "Traceback (most recent call last):\n"
        '  File "/srv/venv/lib/python3.11/site-packages/tool/core.py", line 12, in run\n'
        "    do(x)\n"
        "    ^^^^^\n"
        "KeyError: 'weights' in /data/models/resnet/model.onnx\n"
    )
    assert excerpt(output) == "converting graph\nKeyError: 'weights' in model.onnx"
    assert (
        sanitise_text("s3://bucket/a/b, http://h:9/x/y, /var/lib/kiln/x.bin")
        == "s3://bucket/a/b, http://h:9/x/y, x.bin"
    )
    body, raw = public_error({"code": "X", "message": "m", "hint": "h", "details": {"output_tail": output}})
    assert raw == output and public_error(body) == (body, None)  # idempotent: nothing left to take
    assert str(REPO_ROOT) not in json.dumps(body)


def test_a_converter_failure_keeps_the_tool_s_lines_around_the_error() -> None:
    """Issue 27: pnnx's `" is not output of any previous nodes."` alone names nothing."""
    from services.errors import tool_said

    pnnx = "\n".join(
        [
            "pnnxparam = model.pnnx.param",
            "############# pass_level5",
            "############# pass_ncnn",
            "Gather_42 input attention_mask.1",
            '" is not output of any previous nodes.',
            "",
        ]
    )
    said = tool_said(pnnx)
    assert said == '############# pass_ncnn | Gather_42 input attention_mask.1 | " is not output of any previous nodes.'
    # A failure named earlier than the last lines is put in front of them.
    ov = "Check 'false' failed at unconverted_ops_report.cpp:151:\nSummary:\nops:\n-- com.microsoft.Inverse\n"
    assert (
        tool_said(ov, context=1)
        == "Check 'false' failed at unconverted_ops_report.cpp:151: | … | ops: | -- com.microsoft.Inverse"
    )
    # An exception: its type and the frame of the tool that raised it, not only "list index out of range".
    try:
        [][1]
    except IndexError as exc:
        said = tool_said(str(exc), exc)
    assert said.startswith("IndexError: list index out of range (raised at ")
    assert "test_public_errors.py" in said and "in test_a_converter_failure" in said
