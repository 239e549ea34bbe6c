"""Fallback routes: when a target's route fails on a real model, its next-cheapest route runs.

OpenVINO's ONNX reader has no rule for ``com.microsoft.Inverse`` (nor for ``Det``); onnx2tf
converts both to TensorFlow and OpenVINO's TensorFlow reader takes the Inverse. So an ONNX
model around an Inverse reaches the openvino target only by its second route (ONNX →
SavedModel → IR), and one around a Det by none. Both run in process (`kiln compile`) and
through the queued service (API and engine workers on Redis and PostgreSQL). One test
injects a converter that writes a broken file, to show the step reading it names the
converter (CONVERSION_FAILED) rather than blaming the user's model.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from jobs_support import Proc, free_port, migrated_pg, redis_url, service_env, submit, wait_http, wait_job, wait_workers

from kiln_testing.models import matrix_op_onnx
from kiln_testing.tf_models import keras_cnn
from services.pipeline import compile_model
from services.repository.publish import read_manifest
from services.spec import load_spec

FIRST = "onnx → optimize → openvino_ir ⇒ openvino"
SECOND = "onnx → optimize → savedmodel → openvino_ir ⇒ openvino"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fallback-models")
    return {
        "inverse": matrix_op_onnx(root / "inverse.onnx", "Inverse", "com.microsoft"),
        "det": matrix_op_onnx(root / "det.onnx", "Det"),
    }


def _spec(targets: list[str]) -> Any:
    return load_spec({"targets": targets, "name": "m", "benchmark": False, "validation": {"samples": 4}})


def test_openvino_falls_back_to_the_tensorflow_route_and_says_so(models: dict[str, Path], store, repository) -> None:
    events: list[dict[str, Any]] = []
    result = compile_model(
        models["inverse"], _spec(["openvino"]), store=store, repository=repository, on_event=events.append
    )
    target = result.targets["openvino"]
    assert target.status == "succeeded", target.error
    assert target.route == SECOND
    assert target.parity["passed"] and target.parity["outputs"][0]["max_abs"] < 1e-4
    first, second = target.attempts
    assert (first["rank"], first["status"], first["code"]) == (1, "failed", "CONVERSION_FAILED")
    assert first["step"] == "optimize/onnx-to-openvino-ir" and first["tool"] == "openvino.convert_model"
    assert "com.microsoft.Inverse" in first["message"]
    assert (second["rank"], second["route"], second["status"]) == (2, SECOND, "succeeded")
    # The log: the failed step, then the route change, then the second route's steps.
    kinds = [
        (e["type"], e.get("step")) for e in events if e["type"] in ("step_failed", "route_failed", "step_finished")
    ]
    assert kinds.index(("step_failed", "optimize/onnx-to-openvino-ir")) < kinds.index(("route_failed", first["step"]))
    assert ("step_finished", "export:openvino@2") in kinds and ("step_finished", "export:openvino") not in kinds
    change = next(e for e in events if e["type"] == "route_failed")
    assert change["target"] == "openvino" and change["next_route"] == SECOND
    # The manifest of the published version records both attempts.
    manifest = read_manifest(repository, "m", 1)
    assert manifest["route"] == SECOND
    assert [(a["rank"], a["status"]) for a in manifest["route_attempts"]] == [(1, "failed"), (2, "published")]
    assert manifest["route_attempts"][0]["tool"] == "openvino.convert_model"
    assert "onnx2tf" in {s["tool"] for s in manifest["steps"]}


def test_when_every_route_fails_the_error_names_each_attempt(models: dict[str, Path], store, repository) -> None:
    result = compile_model(models["det"], _spec(["openvino", "onnxruntime"]), store=store, repository=repository)
    assert result.targets["onnxruntime"].status == "succeeded"  # onnxruntime runs Det; only openvino fails
    target = result.targets["openvino"]
    assert target.status == "failed"
    err = target.error
    assert err["code"] == "CONVERSION_FAILED"
    assert err["message"].startswith("every route to openvino failed: (1) " + FIRST)
    assert f"(2) {SECOND}: CONVERSION_FAILED" in err["message"] and "Det" in err["message"]
    attempts = err["details"]["attempts"]
    assert [(a["rank"], a["step"], a["tool"]) for a in attempts] == [
        (1, "optimize/onnx-to-openvino-ir", "openvino.convert_model"),
        (2, "optimize/onnx-to-savedmodel/savedmodel-to-openvino-ir", "openvino.convert_model"),
    ]
    assert [a["status"] for a in target.attempts] == ["failed", "failed"]
    assert "export:openvino@2" not in result.steps


def test_a_converter_writing_a_broken_model_is_named_and_the_next_route_runs(
    tmp_path: Path, store, repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.artifacts import Artifact
    from services.converters import tensorflow_to_onnx

    def truncated_onnx(ctx: Any) -> Artifact:  # a converter that "succeeds" with half a file
        (ctx.out_dir / "model.onnx").write_bytes(b"\x08\x07\x12\x07tf2onnx:\x8a")
        return Artifact(root=ctx.out_dir, kind="onnx", entry="model.onnx", meta={"tool": "tf2onnx"})

    monkeypatch.setattr(tensorflow_to_onnx, "keras_to_onnx", truncated_onnx)
    keras = keras_cnn(tmp_path / "cnn.keras")
    result = compile_model(keras, _spec(["onnxruntime"]), store=store, repository=repository)
    target = result.targets["onnxruntime"]
    assert target.status == "succeeded", target.error
    assert target.route == "keras → savedmodel → onnx → optimize ⇒ onnxruntime"
    first = target.attempts[0]
    # The optimiser could not read it: the tool that wrote it is to blame, not the user's file.
    assert (first["code"], first["tool"], first["step"]) == ("CONVERSION_FAILED", "tf2onnx", "keras-to-onnx")
    assert "wrote a model that kiln passes cannot read" in first["message"]
    assert target.parity["outputs"][0]["max_abs"] < 1e-4


def test_routing_rules_on_a_keras_plan() -> None:
    from services.formats import Format
    from services.graph.planner import plan_routes
    from services.pipeline.fallback import all_routes_failed, needed_steps, routing

    plan = plan_routes(Format.KERAS, load_spec({"targets": ["openvino"]}))
    assert [o.route for o in plan.route_options("openvino")] == [
        "keras → savedmodel → openvino_ir ⇒ openvino",
        "keras → onnx → optimize → openvino_ir ⇒ openvino",
        "keras → savedmodel → onnx → optimize → openvino_ir ⇒ openvino",
    ]
    status = {s.id: "pending" for s in plan.steps}
    status["reference"] = "succeeded"
    now, later = needed_steps(plan, routing(plan, status, {}))
    assert now == {"reference", "keras-to-savedmodel", "keras-to-savedmodel/savedmodel-to-openvino-ir"} | {
        "export:openvino",
        "publish:openvino",
    }
    assert "export:openvino@3" in later
    # A timeout is not the route's fault: nothing else is tried.
    timeout = {"code": "TIMEOUT", "message": "took too long", "details": {"step": "keras-to-savedmodel"}}
    r = routing(plan, {**status, "keras-to-savedmodel": "failed"}, {"keras-to-savedmodel": timeout})["openvino"]
    assert r.decided and [a.status for a in r.attempts] == ["failed", "not tried", "not tried"]
    assert needed_steps(plan, {"openvino": r}) == (set(), set())
    # The SavedModel export failing sinks routes 1 and 3 (both start with it): route 2 runs.
    failed = {"code": "CONVERSION_FAILED", "message": "boom", "details": {"step": "keras-to-savedmodel", "tool": "x"}}
    r = routing(plan, {**status, "keras-to-savedmodel": "failed"}, {"keras-to-savedmodel": failed})["openvino"]
    assert r.active == 1 and [a.status for a in r.attempts] == ["failed", "running", "not tried"]
    # ...and when route 2 fails too, route 3 fails at the same step as route 1: said once, not twice.
    status2 = {**status, "keras-to-savedmodel": "failed", "keras-to-onnx": "failed"}
    errors2 = {
        "keras-to-savedmodel": failed,
        "keras-to-onnx": {"code": "CONVERSION_FAILED", "message": "no", "details": {"step": "keras-to-onnx"}},
    }
    r = routing(plan, status2, errors2)["openvino"]
    assert [a.status for a in r.attempts] == ["failed", "failed", "failed"]
    err = all_routes_failed(r)
    assert err is not None and err["message"].endswith(
        "(3) keras → savedmodel → onnx → optimize → openvino_ir ⇒ openvino: keras-to-savedmodel again"
    )


# ----------------------------------------------------------------------------- the queued service


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The API and one worker per CPU engine on Redis and PostgreSQL."""
    root = tmp_path_factory.mktemp("fallback-service")
    port = free_port()
    env = {
        "database_url": migrated_pg(),
        "broker_url": redis_url(),
        "repository": str(root / "repo"),
        "artifact_store": str(root / "store"),
    }
    procs: list[Proc] = []
    try:
        for engine in ("onnxruntime", "openvino", "tensorflow"):
            procs.append(
                Proc(
                    ["worker", "--engine", engine, "--concurrency", "1"],
                    service_env(cache_dir=root / f"cache-{engine}", **env),
                    root / f"worker-{engine}.log",
                )
            )
        procs.append(Proc(["api", "--port", str(port)], service_env(cache_dir=root / "api", **env), root / "api.log"))
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthz", proc=procs[-1])
        wait_workers(base, {"onnxruntime", "openvino", "tensorflow"}, procs=procs)
        yield base, root
    finally:
        for p in procs:
            p.stop()


def test_the_queued_service_falls_back_across_engine_workers(
    service: tuple[str, Path], models: dict[str, Path]
) -> None:
    base, root = service
    spec = {"targets": ["openvino"], "name": "inv", "benchmark": False, "validation": {"samples": 4}}
    job = wait_job(base, submit(base, models["inverse"], spec).json()["id"], timeout=240)
    assert job["status"] == "succeeded", json.dumps(job["targets"])[:2000]
    target = job["targets"]["openvino"]
    assert target["route"] == SECOND
    assert [(a["rank"], a["status"]) for a in target["attempts"]] == [(1, "failed"), (2, "succeeded")]
    assert target["attempts"][0]["tool"] == "openvino.convert_model"
    steps = {s["id"]: s for s in job["steps"]}
    assert steps["optimize/onnx-to-openvino-ir"]["status"] == "failed"
    assert steps["optimize/onnx-to-savedmodel"]["queue"] == "kiln.tensorflow"
    assert steps["optimize/onnx-to-savedmodel"]["status"] == "succeeded"
    assert steps["export:openvino@2"]["status"] == steps["publish:openvino@2"]["status"] == "succeeded"
    assert steps["export:openvino"]["status"] == "skipped"
    logs = httpx.get(f"{base}/jobs/{job['id']}/logs").text
    line = next(ln for ln in logs.splitlines() if " route_failed " in ln)
    assert "route 1" in line and "openvino.convert_model" in line and f"trying route 2: {SECOND}" in line
    manifest = json.loads((root / "repo" / "triton" / "inv" / "1" / "kiln-manifest.json").read_text())
    assert manifest["route"] == SECOND
    assert [(a["rank"], a["status"]) for a in manifest["route_attempts"]] == [(1, "failed"), (2, "published")]
    # The artifact to download is the one the second route built.
    r = httpx.get(f"{base}/jobs/{job['id']}/artifacts/openvino")
    assert r.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        assert {Path(m.name).name for m in tar.getmembers() if m.isfile()} == {"model.xml", "model.bin"}


def test_a_parity_failure_is_never_hidden_behind_a_later_route_s_conversion_failure() -> None:
    """Issue 27: route 1 built an artifact that computes the wrong numbers, route 2 could not build one;
    the target's error is PARITY_FAILED (the failure that decided it) and lists both."""
    from services.formats import Format
    from services.graph.planner import plan_routes
    from services.pipeline.fallback import all_routes_failed, routing

    plan = plan_routes(Format.KERAS, load_spec({"targets": ["openvino"]}))
    first, second = (o.route for o in plan.route_options("openvino")[:2])
    status = {s.id: "pending" for s in plan.steps}
    status.update({"reference": "succeeded", "keras-to-savedmodel": "succeeded"})
    status.update({"keras-to-savedmodel/savedmodel-to-openvino-ir": "succeeded", "export:openvino": "failed"})
    status["keras-to-onnx"] = "failed"
    parity = {"outputs": [{"name": "logits", "pearson": 0.5}], "passed": False}
    errors = {
        "export:openvino": {
            "code": "PARITY_FAILED",
            "message": "openvino fp32 artifact differs from the source: logits: Pearson 0.5000 < 0.9999",
            "hint": "The fp32 artifact computes something other than the source",
            "details": {"step": "export:openvino", "tool": "export_openvino", "parity": parity},
        },
        "keras-to-onnx": {
            "code": "CONVERSION_FAILED",
            "message": "tf2onnx: IndexError",
            "details": {"tool": "tf2onnx"},
        },
    }
    r = routing(plan, status, errors)["openvino"]
    assert [a.status for a in r.attempts[:2]] == ["failed", "failed"]
    err = all_routes_failed(r)
    assert err is not None and err["code"] == "PARITY_FAILED"
    assert f"(1) {first}: PARITY_FAILED" in err["message"] and f"(2) {second}: CONVERSION_FAILED" in err["message"]
    assert err["details"]["parity"] == parity
    assert [a["code"] for a in err["details"]["attempts"]][:2] == ["PARITY_FAILED", "CONVERSION_FAILED"]
