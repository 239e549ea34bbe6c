"""Issue 19 through the service: inputs that only real values can feed, over POST /compile.

A real `kiln serve` (API and its embedded onnxruntime and openvino workers) on a free port,
HTTP all the way, as tests/test_service_e2e.py runs it. Two models that generated samples
cannot compile soundly:

- a scripted TorchScript module ``forward(x, sr: int)``: the spec pins ``inputs.sr.value``, the
  converter bakes it in, and the published signature has ``x`` alone;
- a streaming cell with ``state [2, B, 16]`` (batch on axis 1) and a 0-d int64 ``sr``: its
  samples are uploaded as the ``calibration`` part in the whole-feed layout
  (``<sample>/<input>``), since no array of them stacks on axis 0.
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from jobs_support import Proc, kiln_serve

from kiln_testing.models import (
    rate_dependent_torchscript,
    stateful_scalar_feeds,
    stateful_scalar_onnx,
    stateful_scalar_step,
)

pytestmark = pytest.mark.timeout(900)

TARGETS = ["onnxruntime", "openvino"]
#: A conversion on a shared 2-core machine takes a while; a job that hangs still fails the test.
JOB_TIMEOUT = 600


@dataclasses.dataclass
class Service:
    base: str
    proc: Proc


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with kiln_serve(tmp_path_factory.mktemp("real-inputs"), set(TARGETS)) as (base, proc):
        yield Service(base, proc)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rate_dependent_torchscript(tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def stateful(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stateful_scalar_onnx(tmp_path_factory.mktemp("stateful") / "stateful.onnx")


def _post(
    service: Service, model: Path, spec: dict[str, Any], calibration: tuple[str, bytes] | None = None
) -> httpx.Response:
    """POST /compile: the model, the spec and (optionally) the calibration file as its own part."""
    files: dict[str, Any] = {
        "model": (model.name, model.read_bytes(), "application/octet-stream"),
        "spec": (None, json.dumps(spec), "application/json"),
    }
    if calibration is not None:
        files["calibration"] = (calibration[0], calibration[1], "application/octet-stream")
    assert service.proc.alive(), service.proc.tail()
    return httpx.post(f"{service.base}/compile", files=files, params={"cache": "false"}, timeout=120)


def _run(
    service: Service, model: Path, spec: dict[str, Any], calibration: tuple[str, bytes] | None = None
) -> dict[str, Any]:
    r = _post(service, model, spec, calibration)
    assert r.status_code == 202, r.text
    job_id, deadline = r.json()["id"], time.monotonic() + JOB_TIMEOUT
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        # A service that died fails the test now, with its log, not after the job timeout.
        assert service.proc.alive(), f"kiln serve exited:\n{service.proc.tail()}"
        job = httpx.get(f"{service.base}/jobs/{job_id}", timeout=10).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish in {JOB_TIMEOUT}s: {json.dumps(job)[:2000]}")


def _npz(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def _manifest(base: str, job: dict[str, Any], target: str) -> dict[str, Any]:
    """The published version's kiln-manifest.json, found through GET /repository (a local repository here)."""
    published = job["targets"][target]["published"]
    models = {m["name"]: m for m in httpx.get(f"{base}/repository", timeout=30).json()["models"]}
    version = next(v for v in models[published["name"]]["versions"] if v["version"] == published["version"])
    assert version["job_id"] == job["id"], version
    folder = Path(version["uri"].removeprefix("file://"))
    return json.loads((folder / "kiln-manifest.json").read_text())


def _artifact(base: str, job: dict[str, Any], target: str) -> dict[str, bytes]:
    """The target's artifact as GET /jobs/{id}/artifacts/{target} serves it: file name -> bytes."""
    r = httpx.get(f"{base}{job['targets'][target]['download_url']}", timeout=60)
    assert r.status_code == 200, r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tf:
        return {Path(m.name).name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}  # type: ignore[union-attr]


def _ir_parameters(xml: bytes) -> dict[str, str]:
    """An OpenVINO IR's inputs (its Parameter layers) in order: name -> shape as the IR writes it ("2,?,16")."""
    layers = [layer for layer in ET.fromstring(xml).iter("layer") if layer.get("type") == "Parameter"]
    return {layer.get("name", ""): layer.find("data").get("shape", "") for layer in layers}  # type: ignore[union-attr]


def _assert_succeeded(job: dict[str, Any]) -> None:
    assert job["status"] == "succeeded", json.dumps(job["targets"], default=str)[:3000]
    for target in TARGETS:
        t = job["targets"][target]
        assert t["status"] == "succeeded", (target, t.get("error"))
        assert t["parity"]["passed"] is True, (target, t["parity"])
        assert t["published"]["version"] >= 1, (target, t["published"])


# --- a scripted TorchScript module with an int argument ---------------------------------------------


def _rate_spec(name: str = "rate-api", **inputs: Any) -> dict[str, Any]:
    return {"targets": TARGETS, "name": name, "benchmark": False, "inputs": inputs}


def test_post_compile_bakes_an_int_argument_pinned_by_the_spec(service: Service, scripted: Path) -> None:
    job = _run(service, scripted, _rate_spec(x={"shape": [-1, 8]}, sr={"value": 16000}))
    _assert_succeeded(job)
    assert job["source"]["format"] == "torchscript", job["source"]
    for target in TARGETS:
        # Only x is fed: the pinned argument is no input of the source run or of the artifact.
        provenance = job["targets"][target]["parity"]["input_provenance"]
        assert {k for k in provenance if not k.startswith("shape ")} == {"x"}, (target, provenance)
        manifest = _manifest(service.base, job, target)
        assert manifest["static_arguments"] == {"sr": 16000}, (target, manifest["static_arguments"])
        assert [i["name"] for i in manifest["io"]["inputs"]] == ["x"], (target, manifest["io"])
    files = _artifact(service.base, job, "onnxruntime")
    graph = onnx.load_from_string(files["model.onnx"]).graph
    assert [i.name for i in graph.input] == ["x"]
    assert list(_ir_parameters(_artifact(service.base, job, "openvino")["model.xml"])) == ["x"]
    # The published graph computes the branch for 16000 (relu: nothing negative), not 3*tanh.
    x = np.random.default_rng(3).standard_normal((5, 8)).astype(np.float32)
    session = ort.InferenceSession(files["model.onnx"], providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x})[0]
    assert got.shape == (5, 4) and got.min() >= 0.0 and (got == 0.0).any(), got


def test_post_compile_of_the_int_argument_without_a_value_fails_saying_how_to_pin_it(
    service: Service, scripted: Path
) -> None:
    job = _run(service, scripted, _rate_spec(x={"shape": [-1, 8]}, name="rate-api-unpinned"))
    assert job["status"] == "failed", job["status"]
    for target in TARGETS:
        error = job["targets"][target]["error"]
        assert error["code"] == "INVALID_SPEC" and "sr: int" in error["message"], (target, error)
        assert "inputs.sr.value" in error["hint"], (target, error)
        assert not job["targets"][target].get("published"), (target, job["targets"][target])


# --- a streaming model: a state batched on axis 1 and a 0-d int64 input, fed whole feeds -------------

N_FEEDS = 8


def test_post_compile_takes_whole_feeds_for_a_state_and_a_scalar(service: Service, stateful: Path) -> None:
    feeds = stateful_scalar_feeds(N_FEEDS)
    assert feeds["0/sr"].shape == () and feeds["0/state"].shape == (2, 1, 16)
    spec = {"targets": TARGETS, "name": "stateful-api", "benchmark": False, "calibration": "feeds.npz"}
    job = _run(service, stateful, spec, ("feeds.npz", _npz(feeds)))
    _assert_succeeded(job)
    assert job["spec"]["calibration"] == "feeds.npz"
    whole = "whole feeds of the calibration file"
    for target in TARGETS:
        parity = job["targets"][target]["parity"]
        assert parity["inputs_from"] == "calibration", (target, parity)
        # Every fourth feed is held out for parity, the rest to validation.min_unseen_samples made from the
        # feeds; each reaches the engine as uploaded, sr as a 0-d scalar.
        held = N_FEEDS // 4
        assert parity["samples"] == max(held, 8), (target, parity)
        assert parity["evidence"]["real"] == held and parity["evidence"]["unseen"] == max(held, 8), parity
        assert parity["shapes"][0] == {"x": [1, 8], "state": [2, 1, 16], "sr": []}, (target, parity["shapes"])
        assert all(o["values"] > 0 and o["pearson"] > 0.999 for o in parity["outputs"]), (target, parity)
        manifest = _manifest(service.base, job, target)
        provenance = dict(manifest["parity"]["input_provenance"])
        # Few rows held out: the page and the manifest say so, and what was made up for them.
        assert f"only {held} of the file's {N_FEEDS} rows are held out" in provenance.pop("held out"), provenance
        assert "mixed with another" in provenance.pop("synthesized"), provenance
        assert provenance == {"x": whole, "state": whole, "sr": whole}, (target, manifest["parity"])
        assert manifest["static_arguments"] == {}
    # The published onnxruntime graph still takes the state on axis 1 and sr as a scalar, and
    # carries a stream forward as the source does.
    model = _artifact(service.base, job, "onnxruntime")["model.onnx"]
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in session.get_inputs()}
    assert shapes["sr"] == [] and len(shapes["state"]) == 3 and shapes["state"][0] == 2, shapes
    feed = {"x": feeds["3/x"], "state": feeds["3/state"], "sr": feeds["3/sr"]}
    y, new_state = session.run(["y", "new_state"], feed)
    want = stateful_scalar_step(**feed)
    np.testing.assert_allclose(y, want["y"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_state, want["new_state"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_state, feeds["4/state"], rtol=1e-5, atol=1e-6)  # the next feed's state
    # The IR keeps the state's batch on axis 1 and sr 0-d (OpenVINO refuses a [1] for a 0-d port).
    ir = _ir_parameters(_artifact(service.base, job, "openvino")["model.xml"])
    assert list(ir) == ["x", "state", "sr"] and ir["sr"] == "" and ir["state"].startswith("2,"), ir


def test_post_compile_refuses_stacked_arrays_for_a_scalar_input_and_names_the_whole_feed_layout(
    service: Service, stateful: Path
) -> None:
    """The same values keyed by input name: a 0-d sr has no axis 0 to stack samples on."""
    feeds = stateful_scalar_feeds(N_FEEDS)
    stacked = {
        "x": np.concatenate([feeds[f"{i}/x"] for i in range(N_FEEDS)]),
        "state": np.concatenate([feeds[f"{i}/state"] for i in range(N_FEEDS)], axis=1),
        "sr": feeds["0/sr"],
    }
    spec = {"targets": TARGETS, "name": "stateful-api-stacked", "benchmark": False, "calibration": "stacked.npz"}
    job = _run(service, stateful, spec, ("stacked.npz", _npz(stacked)))
    assert job["status"] == "failed", job["status"]
    for target in TARGETS:
        error = job["targets"][target]["error"]
        assert error["code"] == "INVALID_SPEC", (target, error)
        assert "<sample>/<input>" in error["hint"], (target, error)
