"""POST /tune against a real `kiln serve` (API + embedded worker, real engines), on a CNN built here.

The tune runs as a job: one search step on the kiln.tune queue, then the publish of what it
recommends. These tests follow it as a pipeline would (202, events, GET /jobs/{id}) and read
what it published from the repository the servers load.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from jobs_support import kiln_serve, read_sse, wait_job

from kiln_testing.models import tiny_cnn_onnx

pytestmark = pytest.mark.timeout(600)

FAST = {"rounds": 10, "warmup": 2, "concurrency": [1, 2]}
SHARED = {"validation": {"samples": 4}}


@dataclass
class Service:
    base: str
    repo: Path
    model: Path


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("tune-service")
    with kiln_serve(root, {"onnxruntime", "openvino", "tune"}) as (base, _):
        yield Service(base, root / "repo", tiny_cnn_onnx(root / "cnn.onnx"))


def _tune(service: Service, tune: dict[str, Any], spec: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
    with open(service.model, "rb") as fh:
        files: dict[str, Any] = {
            "model": (service.model.name, fh, "application/octet-stream"),
            "tune": (None, json.dumps(tune), "application/json"),
        }
        if spec is not None:
            files["spec"] = (None, json.dumps(spec), "application/json")
        return httpx.post(f"{service.base}/tune", files=files, timeout=60, **kw)


def _manifest(repo: Path, published: dict[str, Any]) -> dict[str, Any]:
    found = list(repo.glob(f"*/{published['name']}/{published['version']}/kiln-manifest.json"))
    assert len(found) == 1, found
    return json.loads(found[0].read_text())


def test_a_tune_job_searches_engines_and_precisions_and_publishes_its_recommendation(service: Service) -> None:
    r = _tune(
        service,
        {"targets": ["onnxruntime", "openvino"], "precisions": ["fp32", "int8"], **FAST},
        {**SHARED, "name": "cnn-tuned"},
    )
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    events = read_sse(service.base, job_id, timeout=400)
    job = wait_job(service.base, job_id, timeout=60)
    assert job["status"] == "succeeded", json.dumps(job)[:3000]
    assert job["kind"] == "tune"
    report = job["tune"]
    rec = report["recommendation"]

    # Two engines × two precisions × at least two settings each, every one built, checked and timed.
    timed = [c for c in report["candidates"] if c["status"] == "timed"]
    assert {(c["target"], c["precision"]) for c in timed} == {
        (t, p) for t in ("onnxruntime", "openvino") for p in ("fp32", "int8")
    }
    for pair in {(c["target"], c["precision"]) for c in timed}:
        assert (
            len({json.dumps(c["settings"], sort_keys=True) for c in timed if (c["target"], c["precision"]) == pair})
            >= 2
        )
    assert all(c["p50_ms"] > 0 and c["rounds"] >= 1 for c in timed)

    # The recommendation is the qualifying candidate with the lowest p50; its runner-up is another one.
    qualifying = [c for c in timed if c["meets_constraints"]]
    assert rec["id"] == min(qualifying, key=lambda c: c["p50_ms"])["id"]
    assert rec["runner_up"]["id"] != rec["id"] and rec["margin"] is not None

    # Candidates arrived while the search ran: builds per precision, then the timings, then the pick.
    tune_events = [e["tune"]["type"] for e in events if e.get("type") == "progress" and e.get("tune")]
    assert (
        tune_events.index("tune_built")
        < tune_events.index("tune_candidates")
        < tune_events.index("tune_recommendation")
    )
    assert tune_events.count("tune_built") == 2  # fp32, then int8
    finished = [e["type"] for e in events].index("step_finished")
    assert all(i < finished for i, e in enumerate(events) if e.get("type") == "progress" and e.get("tune")), (
        "tune progress after its step finished"
    )

    # Published: the recommendation's own artifact, with the tune in its manifest and its settings in Triton's config.
    target = job["targets"]["tune"]
    assert target["status"] == "succeeded"
    published = target["published"]
    manifest = _manifest(service.repo, published)
    assert (manifest["target"], manifest["precision"]) == (rec["target"], rec["precision"])
    assert manifest["tune"]["chosen"]["id"] == rec["id"]
    assert manifest["tune"]["profiles"]["recommendation"]["available"] is True
    assert {s["kind"] for s in manifest["steps"]} >= {"reference", "export", "tune"}
    if rec["target"] in ("onnxruntime", "openvino"):
        config = (service.repo / "triton" / published["name"] / "config.pbtxt").read_text()
        threads = rec["settings"]["threads"]
        key = "intra_op_thread_count" if rec["target"] == "onnxruntime" else "INFERENCE_NUM_THREADS"
        assert f'key: "{key}"' in config and f'string_value: "{threads}"' in config, config
    # The artifact download is the recommendation's export.
    tar = httpx.get(f"{service.base}/jobs/{job_id}/artifacts/tune", timeout=30)
    assert tar.status_code == 200 and len(tar.content) > 1000


def test_the_throughput_objective_publishes_the_batch_and_instances_of_its_curve(service: Service) -> None:
    r = _tune(
        service,
        {"targets": ["onnxruntime"], "precisions": ["fp32"], "objective": "throughput", "batch": [1, 4], **FAST},
        {**SHARED, "name": "cnn-throughput"},
    )
    assert r.status_code == 202, r.text
    job = wait_job(service.base, r.json()["id"], timeout=400)
    assert job["status"] == "succeeded", json.dumps(job)[:3000]
    serving = job["tune"]["recommendation"]["serving"]
    curve = serving["curve"]
    measured = [p for p in curve["points"] if p["throughput"] is not None]
    assert {(p["batch"], p["instances"]) for p in measured} == {(b, n) for b in (1, 4) for n in (1, 2)}
    assert (serving["batch"], serving["instances"]) == (curve["pick"]["batch"], curve["pick"]["instances"])
    config = (service.repo / "triton" / "cnn-throughput" / "config.pbtxt").read_text()
    assert f"count: {serving['instances']}" in config
    assert f"preferred_batch_size: {serving['batch']}" in config


def test_a_tune_nothing_qualifies_for_fails_with_no_candidate_and_keeps_its_report(service: Service) -> None:
    r = _tune(
        service, {"targets": ["onnxruntime"], "precisions": ["fp32"], "max_p99_ms": 1e-6, **FAST}, {"name": "none"}
    )
    assert r.status_code == 202, r.text
    job = wait_job(service.base, r.json()["id"], timeout=300)
    assert job["status"] == "failed"
    error = job["targets"]["tune"]["error"]
    assert error["code"] == "NO_CANDIDATE" and error["hint"]
    report = job["tune"]
    assert report["recommendation"] is None
    timed = [c for c in report["candidates"] if c["status"] == "timed"]
    assert timed and all(any("p99" in v for v in c["violations"]) for c in timed)
    assert not list(service.repo.glob("*/none/*")), "nothing is published when nothing qualifies"
    missing = httpx.get(f"{service.base}/jobs/{job['id']}/artifacts/tune", timeout=30)
    assert missing.status_code == 404 and missing.json()["code"] == "NOT_FOUND", missing.text
    assert all(c.get("artifact") is None for c in report["candidates"]), "no worker paths in the report"


@pytest.mark.parametrize(
    ("tune", "field"),
    [
        ({"objective": "fastest"}, "tune.objective"),
        ({"batch": [0]}, "tune.batch"),
        ({"precisions": ["fp8"]}, "tune.precisions.0"),
        ({"rounds": 10, "surprise": 1}, "tune.surprise"),
    ],
)
def test_bad_tune_options_are_refused_naming_the_field(service: Service, tune: dict[str, Any], field: str) -> None:
    r = _tune(service, tune)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "INVALID_SPEC" and body["hint"]
    assert field in [e["field"] for e in body["details"]["errors"]]


def test_an_unknown_target_and_unreadable_tune_json_are_refused(service: Service) -> None:
    r = _tune(service, {"targets": ["onnxruntime", "nope"]})
    assert r.status_code == 422 and "nope" in r.json()["message"]
    with open(service.model, "rb") as fh:
        files = {
            "model": (service.model.name, fh, "application/octet-stream"),
            "tune": (None, "{not json", "application/json"),
        }
        r = httpx.post(f"{service.base}/tune", files=files, timeout=60)
    assert r.status_code == 422 and r.json()["code"] == "INVALID_SPEC"


def test_the_same_idempotency_key_with_other_tune_options_is_refused(service: Service) -> None:
    key = {"Idempotency-Key": "tune-key-1"}
    first = _tune(service, {"targets": ["onnxruntime"], "precisions": ["fp32"], **FAST}, {"name": "idem"}, headers=key)
    assert first.status_code == 202, first.text
    again = _tune(service, {"targets": ["onnxruntime"], "precisions": ["fp32"], **FAST}, {"name": "idem"}, headers=key)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = _tune(service, {"targets": ["onnxruntime"], "precisions": ["fp16"], **FAST}, {"name": "idem"}, headers=key)
    assert other.status_code == 409 and other.json()["code"] == "IDEMPOTENCY_KEY_REUSED"
    wait_job(service.base, first.json()["id"], timeout=300)


def test_a_resubmitted_tune_is_a_tune_answered_from_the_cache(service: Service) -> None:
    goals = {"targets": ["onnxruntime"], "precisions": ["fp32"], **FAST}
    first = wait_job(service.base, _tune(service, goals, {"name": "again"}).json()["id"], timeout=300)
    assert first["status"] == "succeeded"
    r = httpx.post(f"{service.base}/jobs/{first['id']}/resubmit", json={}, timeout=60)
    assert r.status_code == 202, r.text
    again = wait_job(service.base, r.json()["id"], timeout=300)
    assert again["status"] == "succeeded" and again["kind"] == "tune"
    assert again["plan"]["steps"][0]["options"] == first["plan"]["steps"][0]["options"]
    search = next(s for s in again["steps"] if s["id"] == "tune")
    assert search["cached"], "an identical tune is answered from the step cache"
    assert again["tune"]["recommendation"]["id"] == first["tune"]["recommendation"]["id"]
