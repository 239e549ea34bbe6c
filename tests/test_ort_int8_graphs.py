"""onnxruntime int8 on graphs as older exporters and Paddle write them.

Each case failed inside Kiln before the exporter handled it, on real PP-OCR models first
(issue 19): a per-channel QDQ graph below opset 13 that onnxruntime then refuses to load, and
a Gemm bias shaped [1, N] on which onnxruntime's quantiser raises a numpy ValueError.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from services.pipeline import compile_model
from services.spec import load_spec


def _save(path: Path, nodes: list, x_shape: list[int], y_shape: list[int], weights: list, opset: int) -> Path:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 6
    onnx.save(model, str(path))
    return path


def _int8(model: Path, store, repository):
    spec = load_spec({"targets": ["onnxruntime"], "precision": "int8", "name": "m", "benchmark": False})
    return compile_model(model, spec, store=store, repository=repository).targets["onnxruntime"]


def _published(repo_dir: Path) -> tuple[dict, Path]:
    version = repo_dir / "triton" / "m" / "1"
    return json.loads((version / "kiln-manifest.json").read_text())["engine_details"], version / "model.onnx"


def test_an_opset_11_conv_is_upgraded_for_per_channel_weights(
    tmp_path: Path, store, repository, repo_dir: Path
) -> None:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(8, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.normal(size=(8,)).astype(np.float32), "b")
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    model = _save(tmp_path / "conv11.onnx", nodes, [1, 3, 16, 16], [1, 8, 16, 16], [w, b], opset=11)
    t = _int8(model, store, repository)
    assert t.status == "succeeded", t.error
    details, published = _published(repo_dir)
    int8 = details["int8"]
    assert int8["per_channel"] is True and int8["opset_upgrade"]["from"] == 11 and int8["opset_upgrade"]["to"] == 13
    nodes = onnx.load(str(published)).graph.node
    assert any(n.op_type == "DequantizeLinear" and any(a.name == "axis" for a in n.attribute) for n in nodes)
    ort.InferenceSession(str(published))  # the graph onnxruntime refused before


def test_a_gemm_bias_shaped_1_by_n_quantises(tmp_path: Path, store, repository, repo_dir: Path) -> None:
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.normal(size=(16, 32)).astype(np.float32), "w")
    c = numpy_helper.from_array(rng.normal(size=(1, 16)).astype(np.float32), "c")
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["g"], transB=1), helper.make_node("Relu", ["g"], ["y"])]
    model = _save(tmp_path / "gemm.onnx", nodes, [4, 32], [4, 16], [w, c], opset=13)
    t = _int8(model, store, repository)
    assert t.status == "succeeded", t.error
    int8 = _published(repo_dir)[0]["int8"]
    # Per-channel, onnxruntime gives the [1, N] bias N scales on axis 0 (its size-1 axis) after
    # skipping the int32-bias adjustment, and its own DequantizeLinear refuses that graph unless
    # constant folding hides it: the exporter publishes per-tensor weights instead and says why.
    assert int8["per_channel"] is False and "scale must be 1D tensor" in int8["per_channel_refused"]
    assert t.parity["outputs"][0]["pearson"] > 0.99, t.parity
