"""Legacy and unusual ONNX: old opsets upgraded, the reference from a runtime that runs the source, inputs that
are shapes, hints that match the cause. Models are built here; a few come from ONNX's own backend test data
(inside the onnx wheel, with recorded inputs and outputs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from services.errors import InvalidSpec, KilnError
from services.pipeline import compile_model
from services.spec import load_spec

BACKEND_DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"


def _save(
    path: Path, nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: list[Any] = (), opset: int = 13
) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 3 if opset < 7 else 8
    onnx.save(model, str(path))
    return path


def _compile(model: Path, store: Any, repository: Any, **spec: Any) -> Any:
    body = {"targets": ["onnxruntime", "openvino"], "name": "legacy", "benchmark": False, **spec}
    return compile_model(model, load_spec(body), store=store, repository=repository)


def old_opset_pool(path: Path) -> Path:
    """Opset 6: AveragePool(1) then Add(6) with broadcast=1, axis=1: onnxruntime implements neither version."""
    bias = numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "bias")
    nodes = [
        helper.make_node("AveragePool", ["x"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Add", ["p", "bias"], ["y"], broadcast=1, axis=1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4, 4])
    b = helper.make_tensor_value_info("bias", TensorProto.FLOAT, [3])
    return _save(path, nodes, [x, b], [y], [bias], opset=6)


def test_an_old_opset_model_is_upgraded_and_its_reference_comes_from_a_runtime_that_runs_it(
    tmp_path: Path, store: Any, repository: Any, repo_dir: Path
) -> None:
    import onnxruntime as ort

    model = old_opset_pool(tmp_path / "old.onnx")
    with pytest.raises(Exception, match="NOT_IMPLEMENTED"):  # onnxruntime alone cannot run it
        ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    result = _compile(model, store, repository)
    for target in ("onnxruntime", "openvino"):
        t = result.targets[target]
        assert t.status == "succeeded", (target, t.error)
        # onnxruntime lacks AveragePool(1); onnx.reference's Add has no legacy axis broadcasting: OpenVINO ran it.
        assert t.parity["reference_from"] == "OpenVINO" and t.parity["outputs"][0]["snr_db"] > 80
    manifest = json.loads((repo_dir / "triton" / "legacy-onnxruntime" / "1" / "kiln-manifest.json").read_text())
    upgrade = manifest["opset_upgrade"]
    assert upgrade["from"] == 6 and upgrade["to"] == 7 and "AveragePool" in upgrade["ops"] and "why" in upgrade
    assert upgrade["fixed"]  # the Add's legacy axis=1 operand was given its trailing unit axes


@pytest.mark.parametrize("case", ["test_PReLU_2d_multiparam", "test_AvgPool2d"])
def test_backend_data_old_opset_cases_publish_what_the_recording_says(
    case: str, tmp_path: Path, store: Any, repository: Any
) -> None:
    from services.formats import Format
    from services.runners import open_runner

    folder = BACKEND_DATA / "pytorch-converted" / case
    model = onnx.load(str(folder / "model.onnx"))
    x = numpy_helper.to_array(onnx.load_tensor(str(folder / "test_data_set_0" / "input_0.pb")))
    want = numpy_helper.to_array(onnx.load_tensor(str(folder / "test_data_set_0" / "output_0.pb")))
    name = model.graph.input[0].name
    np.savez(tmp_path / "recorded.npz", **{f"0/{name}": x})  # one whole feed: the recorded input
    result = _compile(folder / "model.onnx", store, repository, calibration=str(tmp_path / "recorded.npz"))
    for target, fmt, entry in (
        ("onnxruntime", Format.ONNX, "model.onnx"),
        ("openvino", Format.OPENVINO_IR, "model.xml"),
    ):
        t = result.targets[target]
        assert t.status == "succeeded", (target, t.error)
        runner = open_runner(fmt, Path(t.published["uri"].removeprefix("file://")) / entry)
        got = next(iter(runner.run({runner.inputs[0].name: x}).values()))
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)  # independently of Kiln's own parity


def expand_by_shape_input(path: Path) -> Path:
    """y = Expand(x, shape): the integer input is a shape, no random value of which is valid."""
    nodes = [helper.make_node("Expand", ["x", "shape"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 1])
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, "W"])
    return _save(path, nodes, [x, shape], [y])


def test_a_shape_input_is_refused_at_submission_asking_for_sample_data_and_compiles_with_it(
    tmp_path: Path, store: Any, repository: Any
) -> None:
    model = expand_by_shape_input(tmp_path / "expand.onnx")
    with pytest.raises(InvalidSpec) as exc:
        _compile(model, store, repository)
    assert "shape" in str(exc.value) and "the shape of an Expand" in str(exc.value) and "calibration" in exc.value.hint
    feeds = {"0/x": np.arange(3, dtype=np.float32).reshape(3, 1), "0/shape": np.array([3, 4], np.int64)}
    np.savez(tmp_path / "feeds.npz", **feeds)
    result = _compile(model, store, repository, calibration=str(tmp_path / "feeds.npz"))
    for target in ("onnxruntime", "openvino"):
        assert result.targets[target].status == "succeeded", result.targets[target].error


def test_indices_into_a_tensor_of_known_size_are_generated_in_range(
    tmp_path: Path, store: Any, repository: Any
) -> None:
    nodes = [helper.make_node("Gather", ["x", "idx"], ["y"], axis=1)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])
    idx = helper.make_tensor_value_info("idx", TensorProto.INT64, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    model = _save(tmp_path / "gather.onnx", nodes, [x, idx], [y])
    result = _compile(model, store, repository)
    t = result.targets["onnxruntime"]
    assert t.status == "succeeded", t.error
    assert "[0, 5)" in t.parity["input_provenance"]["idx"]


def test_a_sequence_input_is_refused_at_submission(tmp_path: Path, store: Any, repository: Any) -> None:
    seq = helper.make_tensor_sequence_value_info("xs", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    pos = numpy_helper.from_array(np.array(0, np.int64), "pos")
    model = _save(tmp_path / "seq.onnx", [helper.make_node("SequenceAt", ["xs", "pos"], ["y"])], [seq], [y], [pos])
    with pytest.raises(InvalidSpec, match="a sequence input"):
        _compile(model, store, repository)


def _relu(path: Path, opset: int = 13) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    return _save(path, [helper.make_node("Relu", ["x"], ["y"])], [x], [y], opset=opset)


def _error(model: Path, store: Any, repository: Any) -> dict[str, Any]:
    try:
        result = _compile(model, store, repository, targets=["onnxruntime"])
    except KilnError as exc:
        return exc.to_dict()
    t = result.targets["onnxruntime"]
    assert t.status == "failed"
    return t.error  # type: ignore[no-any-return]


def test_each_cause_gets_its_own_code_and_hint(tmp_path: Path, store: Any, repository: Any) -> None:
    good = _relu(tmp_path / "good.onnx")
    (tmp_path / "truncated.onnx").write_bytes(good.read_bytes()[:40])
    truncated = _error(tmp_path / "truncated.onnx", store, repository)
    assert truncated["code"] == "SOURCE_UNREADABLE" and "truncated" in truncated["hint"]

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    invalid = _error(
        _save(tmp_path / "invalid.onnx", [helper.make_node("Add", ["x", "nope"], ["y"])], [x], [y]), store, repository
    )
    assert invalid["code"] == "INVALID_MODEL" and "truncated" not in invalid["hint"]

    unknown = _error(
        _save(tmp_path / "unknown.onnx", [helper.make_node("Frobnicate", ["x"], ["y"])], [x], [y]), store, repository
    )
    assert unknown["code"] == "UNSUPPORTED_OPS" and "Frobnicate" in unknown["message"]

    future = _error(_relu(tmp_path / "future.onnx", opset=99), store, repository)
    assert future["code"] == "UNSUPPORTED_OPS" and "opset" in future["hint"] and "truncated" not in future["hint"]


def test_post_compile_refuses_a_shape_input_without_data_at_submission(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from services.settings import Settings
    from workers.app import create_celery_app

    settings = Settings(cache_dir=tmp_path / "cache", data_dir=tmp_path / "data", repository=str(tmp_path / "repo"))
    model = expand_by_shape_input(tmp_path / "expand.onnx")
    with TestClient(create_app(settings, create_celery_app(settings))) as client:
        with open(model, "rb") as fh:
            spec = json.dumps({"targets": ["onnxruntime"]})
            r = client.post("/compile", files={"model": ("expand.onnx", fh), "spec": (None, spec)})
        assert r.status_code == 422, r.text
        body = r.json()
        assert body["code"] == "INVALID_SPEC" and "shape" in body["message"]
        assert body["details"]["errors"][0]["field"] == "inputs.shape"
        assert client.get("/jobs").json()["count"] == 0  # nothing was accepted
