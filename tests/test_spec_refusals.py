"""Specs refused for what the model is: inputs it does not have, and inputs too big to allocate.

The spec alone cannot see the model's dims, so these are checked when the job runs (the
reference step, the benchmark) with the same limit as `load_spec`, before anything is allocated.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from services.errors import InvalidSpec
from services.pipeline import compile_model
from services.spec import load_spec


def wide_identity(path: Path, width: int = 1 << 20) -> Path:
    """output = input, [N, 1048576] float32: 4 MiB a sample, so a large batch is many GiB."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _compile(model: Path, store, repository, **extra):
    spec = load_spec({"targets": ["onnxruntime"], "name": "m", **extra})
    return compile_model(model, spec, store=store, repository=repository).targets["onnxruntime"]


def test_an_input_the_onnx_model_does_not_have_is_refused(cnn_onnx: Path, store, repository, repo_dir: Path) -> None:
    # Refused before any step, as the API refuses it at submission (services/validation/onnx_source.py).
    with pytest.raises(InvalidSpec) as refused:
        _compile(cnn_onnx, store, repository, inputs={"images": {"shape": [1, 3, 32, 32]}})
    error = refused.value.to_dict()
    assert error["code"] == "INVALID_SPEC"
    assert "['images']" in error["message"] and "['input']" in error["message"]
    assert error["details"]["errors"] == [{"field": "inputs.images", "problem": "the model has no such input"}]
    assert not repo_dir.joinpath("m").exists()


def test_a_benchmark_batch_too_big_for_the_models_dims_is_refused_with_an_estimate(
    tmp_path: Path, store, repository, repo_dir: Path
) -> None:
    model = wide_identity(tmp_path / "wide.onnx")
    # 4096 x 1048576 float32 = 16 GiB for one batch: refused before allocating, naming the field.
    target = _compile(model, store, repository, benchmark={"batch_sizes": [1, 4096], "iterations": 1})
    assert target.status == "failed" and target.error["code"] == "INVALID_SPEC"
    problem = target.error["details"]["errors"][0]
    assert problem["field"] == "benchmark.batch_sizes"
    assert "16 GiB" in problem["problem"] and "the limit is 4 GiB" in problem["problem"]
    assert target.published is None


def test_a_validation_set_too_big_for_the_models_dims_is_refused(tmp_path: Path, store, repository) -> None:
    model = wide_identity(tmp_path / "wide.onnx")
    # 1024 samples of 2 x 1048576 float32: 8 GiB of parity inputs.
    target = _compile(model, store, repository, inputs={"x": {"shape": [2, -1]}}, validation={"samples": 1024})
    assert target.status == "failed" and target.error["code"] == "INVALID_SPEC"
    problem = target.error["details"]["errors"][0]
    assert problem["field"] == "inputs.x" and "8 GiB" in problem["problem"]
    assert target.error["details"]["step"] == "reference"


def test_the_same_model_within_limits_compiles(tmp_path: Path, store, repository) -> None:
    model = wide_identity(tmp_path / "wide.onnx", width=1024)
    target = _compile(model, store, repository, benchmark={"batch_sizes": [1, 64], "iterations": 2})
    assert target.status == "succeeded", target.error
