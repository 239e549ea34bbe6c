"""The onnxruntime target end to end: fp32, fp16, int8 for a CNN and a transformer block."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import text_format

from services.pipeline import compile_model
from services.spec import DEFAULT_TOLERANCES, Precision, load_spec


def _compile(model: Path, store, repository, precision: str, **extra):
    spec = load_spec(
        {
            "targets": ["onnxruntime"],
            "precision": precision,
            "name": "m",
            "benchmark": {"iterations": 5, "warmup": 1},
            **extra,
        }
    )
    return compile_model(model, spec, store=store, repository=repository)


@pytest.mark.parametrize("model_fixture", ["cnn_onnx", "transformer_onnx"])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_onnxruntime_precisions(model_fixture: str, precision: str, request, store, repository, repo_dir: Path) -> None:
    model = request.getfixturevalue(model_fixture)
    result = _compile(model, store, repository, precision)
    target = result.targets["onnxruntime"]
    assert target.status == "succeeded", target.error
    parity = target.parity
    tol = DEFAULT_TOLERANCES[Precision(precision)]
    assert parity["passed"] is True
    for out in parity["outputs"]:
        assert out["cosine"] >= tol.min_cosine
        if tol.atol is not None:
            assert out["max_abs"] <= tol.atol + tol.rtol * 10  # outputs are O(1)
    version_dir = repo_dir / "triton" / "m" / "1"
    artifact = onnx.load(str(version_dir / "model.onnx"))
    graph_in = artifact.graph.input[0].type.tensor_type.elem_type
    assert graph_in == onnx.TensorProto.FLOAT  # fp32 I/O kept at every precision
    ops = {n.op_type for n in artifact.graph.node}
    inits = {i.data_type for i in artifact.graph.initializer}
    if precision == "fp16":
        assert onnx.TensorProto.FLOAT16 in inits and "Cast" in ops
    if precision == "int8":
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops
        assert onnx.TensorProto.INT8 in inits
    from tritonclient.grpc import model_config_pb2

    cfg = text_format.Parse((repo_dir / "triton" / "m" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert cfg.platform == "onnxruntime_onnx" and cfg.input[0].name == "input"
    manifest = json.loads((version_dir / "kiln-manifest.json").read_text())
    assert manifest["precision"] == precision and manifest["target"] == "onnxruntime"
    assert manifest["source"]["sha256"] == result.source.sha256
    assert manifest["route"] == "onnx → optimize ⇒ onnxruntime"
    assert "onnxruntime" in manifest["tool_versions"] and "onnx" in manifest["tool_versions"]
    assert manifest["benchmark"][0]["p50_ms"] > 0 and manifest["benchmark"][0]["iterations"] == 5
    assert [s["step"] for s in manifest["steps"]] == ["reference", "optimize", "export:onnxruntime"]
    assert manifest["passes"], "the optimizer's per-pass record reaches the manifest"
    guard = manifest["speed_guard"]  # the optimize step timed its output against its input
    assert guard["checked"] is True and guard["kept"] in ("optimised", "source") and guard["source_ms"] > 0
    if precision == "int8":
        assert "generated samples" in manifest["engine_details"]["int8"]["calibration_data"]


def test_int8_with_calibration_file_and_cache(
    cnn_onnx: Path, tmp_path: Path, store, repository, repo_dir: Path
) -> None:
    calib = tmp_path / "calib.npz"
    np.savez(calib, input=np.random.default_rng(1).standard_normal((12, 3, 32, 32)).astype(np.float32))
    first = _compile(cnn_onnx, store, repository, "int8", calibration=str(calib))
    assert first.targets["onnxruntime"].status == "succeeded"
    assert first.targets["onnxruntime"].parity["inputs_from"] == "calibration"
    # Rows 3, 7, 11 are held out for parity; 5 more are made from the rows to reach min_unseen_samples (8).
    evidence = first.targets["onnxruntime"].parity["evidence"]
    assert (evidence["real"], evidence["synthesized"], evidence["unseen"]) == (3, 5, 8), evidence
    assert first.targets["onnxruntime"].parity["samples_per_shape"][0] == 8
    manifest = json.loads((repo_dir / "triton" / "m" / "1" / "kiln-manifest.json").read_text())
    assert manifest["engine_details"]["int8"]["calibration_data"] == "calibration file"
    assert manifest["engine_details"]["int8"]["samples"] == 9
    again = _compile(cnn_onnx, store, repository, "int8", calibration=str(calib))
    cached = {sid: o.cached for sid, o in again.steps.items()}
    assert cached == {"reference": True, "optimize": True, "export:onnxruntime": True, "publish:onnxruntime": False}
    assert again.targets["onnxruntime"].published["version"] == 1  # the identical version stands: no duplicate


def test_parity_failure_is_reported_with_numbers(cnn_onnx: Path, store, repository) -> None:
    # An impossible bound: the fp16 artifact cannot be bit-exact, so the target must fail.
    result = _compile(cnn_onnx, store, repository, "fp16", tolerances={"atol": 0.0, "rtol": 0.0})
    target = result.targets["onnxruntime"]
    assert target.status == "failed"
    assert target.error["code"] == "PARITY_FAILED"
    assert target.parity["outputs"][0]["max_abs"] > 0
    assert target.published is None


def test_fp32_artifact_is_the_optimised_model_copied_with_its_external_data(cnn_onnx: Path, tmp_path: Path) -> None:
    from services.exporters.onnxruntime import _write_fp32
    from services.onnx_io import load_onnx, save_onnx

    src_dir, out = tmp_path / "optimize", tmp_path / "out"
    src_dir.mkdir()
    out.mkdir()
    files = save_onnx(load_onnx(cnn_onnx), src_dir / "model.onnx", threshold=0)  # weights in model.onnx.data
    _write_fp32(files[0], out / "model.onnx")
    for f in files:  # byte for byte: nothing parsed or re-encoded
        assert (out / f.name).read_bytes() == f.read_bytes()
    assert len(load_onnx(out / "model.onnx").graph.initializer) == len(load_onnx(cnn_onnx).graph.initializer)
    # External data in a subfolder (a source directory or archive, optimize off) is loaded
    # and saved: copying model.onnx alone would leave its weights behind.
    nested = tmp_path / "nested"
    (nested / "weights").mkdir(parents=True)
    onnx.save_model(
        load_onnx(cnn_onnx),
        str(nested / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights/w.bin",
        size_threshold=0,
    )
    _write_fp32(nested / "model.onnx", tmp_path / "nested-out" / "model.onnx")
    assert len(load_onnx(tmp_path / "nested-out" / "model.onnx").graph.initializer) == len(
        load_onnx(cnn_onnx).graph.initializer
    )
    # A source under its own name (optimize off) is loaded and saved under the artifact's.
    _write_fp32(cnn_onnx, tmp_path / "fresh" / "model.onnx")
    assert onnx.load(str(tmp_path / "fresh" / "model.onnx")).graph.node


def test_fp16_keeps_the_float_only_quantisation_ops_of_a_quantised_model_in_float(tmp_path: Path) -> None:
    # A model quantised before it reached Kiln (DynamicQuantizeLinear takes float32 only): its fp16
    # copy used to cast that input to float16, a graph onnxruntime refuses to load (INVALID_GRAPH).
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from services.exporters.onnxruntime import to_fp16

    bias = helper.make_tensor("bias", TensorProto.FLOAT, [4], [0.5, -1.0, 2.0, 0.0])
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("DynamicQuantizeLinear", ["r"], ["q", "scale", "zero"]),
        helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["dq"]),
        helper.make_node("Add", ["dq", "bias"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "quantised",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [bias],
    )
    src, dst = tmp_path / "q.onnx", tmp_path / "q16.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    to_fp16(src, dst)
    x = np.array([[0.1, 0.5, -1.0, 2.0], [3.0, 0.0, 1.5, -0.2]], np.float32)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, atol=2e-2)
    kinds = {n.op_type for n in onnx.load(dst).graph.node}
    assert "DynamicQuantizeLinear" in kinds and "Cast" in kinds  # the rest of the graph did go to fp16
