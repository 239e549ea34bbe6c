"""Parity through real exports: an artifact that gives NaN/inf the source lacks, or nothing at all, is never published."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from services.pipeline import compile_model
from services.spec import load_spec

RELAXED = {"atol": 1e9, "rtol": 1e9, "min_cosine": -1.0, "min_top1": 0.0}


def _onnx(path: Path, nodes: list, inits: list[np.ndarray], width: int, out_width: int) -> Path:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", out_width])],
        [numpy_helper.from_array(a, f"c{i}") for i, a in enumerate(inits)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def log_of_small_column(path: Path) -> Path:
    """output = Log(|x| @ W): one column ~100x the other, so int8's shared scale rounds the small one to 0 (-inf)."""
    w = np.array([[100.0, 1e-3]] * 4, np.float32)
    nodes = [
        helper.make_node("Abs", ["input"], ["a"]),
        helper.make_node("MatMul", ["a", "c0"], ["m"]),
        helper.make_node("Log", ["m"], ["output"]),
    ]
    return _onnx(path, nodes, [w], 4, 2)


def _compile(model: Path, store, repository, target: str, precision: str, **extra):
    spec = load_spec({"targets": [target], "precision": precision, "name": "m", "benchmark": False, **extra})
    return compile_model(model, spec, store=store, repository=repository).targets[target]


@pytest.mark.parametrize("tolerances", [{}, RELAXED], ids=["default", "relaxed"])
def test_int8_artifact_with_infinities_is_not_published(
    tolerances: dict, tmp_path: Path, store, repository, repo_dir: Path
) -> None:
    model = log_of_small_column(tmp_path / "log.onnx")
    fp32 = _compile(model, store, repository, "onnxruntime", "fp32")
    assert fp32.status == "succeeded" and fp32.parity["passed"]  # the source and its fp32 artifact are finite
    # The int8 artifact as static quantisation writes it: auto_exclude would leave the Log's
    # input in float and publish a finite artifact (asserted at the end).
    no_fallback = {"onnxruntime": {"int8": {"auto_exclude": False}}}
    target = _compile(model, store, repository, "onnxruntime", "int8", tolerances=tolerances, options=no_fallback)
    assert target.status == "failed", target.parity
    assert target.error["code"] == "PARITY_FAILED"
    out = target.parity["outputs"][0]
    # 8 samples of [1, 2] and 2 of [2, 2] (the open batch axis doubled): 24 pairs, each compared or non-finite.
    assert out["nonfinite"] > 0 and out["values"] + out["nonfinite"] == 24
    assert target.parity["passed"] is False and "no tolerance accepts" in target.error["hint"]
    assert target.published is None
    assert sorted(p.name for p in (repo_dir / "triton" / "m").iterdir() if p.is_dir()) == ["1"]  # only the fp32 version
    repaired = _compile(model, store, repository, "onnxruntime", "int8", tolerances=tolerances)
    assert repaired.status == "succeeded", repaired.error
    assert repaired.parity["outputs"][0]["nonfinite"] == 0 and repaired.parity["passed"]


def test_openvino_ir_without_outputs_is_not_published(tmp_path: Path, store, repository, repo_dir: Path) -> None:
    import openvino as ov
    from openvino import opset13

    param = opset13.parameter([1, 4], ov.Type.f32, name="input")
    ov.save_model(ov.Model([], [param], "empty"), str(tmp_path / "empty.xml"))
    target = _compile(tmp_path / "empty.xml", store, repository, "openvino", "fp32", tolerances=RELAXED)
    assert target.status == "failed" and target.error["code"] == "PARITY_FAILED"
    assert "nothing to compare" in target.error["message"]
    assert target.parity["outputs"] == [] and target.parity["passed"] is False
    assert target.published is None and not (repo_dir / "triton" / "m").exists()
