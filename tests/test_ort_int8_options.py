"""options.onnxruntime.int8 reaches quantize_static, and a node that int8 ruins is left in float.

The sensitive graph: between two ordinary Convs, a Conv whose first output channel is a thousand
times larger than the other seven, followed by a 1x1 Conv that reads only those seven. One
per-tensor uint8 scale for the shared activation leaves the seven channels a few levels each,
so the output is noise (issue 19: real models lose their signal the same way in a few tensors).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from services.errors import InvalidSpec
from services.pipeline import compile_model
from services.spec import load_spec


def _sensitive_model(path: Path) -> Path:
    rng = np.random.default_rng(3)
    w1 = rng.normal(size=(8, 4, 3, 3)).astype(np.float32) * 0.3
    w1[0] *= 1000.0  # the outlier channel: it sets the shared activation scale
    w2 = rng.normal(size=(4, 8, 1, 1)).astype(np.float32)
    w2[:, 0] = 0.0  # ... and the rest of the graph never reads it
    w0 = rng.normal(size=(4, 4, 3, 3)).astype(np.float32) * 0.3
    w3 = rng.normal(size=(4, 4, 3, 3)).astype(np.float32) * 0.3
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1], name="first_conv"),
        helper.make_node("Relu", ["c0"], ["r0"], name="first_relu"),
        helper.make_node("Conv", ["r0", "w1"], ["c1"], pads=[1, 1, 1, 1], name="wide_conv"),
        helper.make_node("Conv", ["c1", "w2"], ["c2"], name="narrow_conv"),
        helper.make_node("Relu", ["c2"], ["r2"], name="last_relu"),
        helper.make_node("Conv", ["r2", "w3"], ["y"], pads=[1, 1, 1, 1], name="last_conv"),
    ]
    graph = helper.make_graph(
        nodes,
        "sensitive",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 12, 12])],
        [numpy_helper.from_array(w, n) for w, n in ((w0, "w0"), (w1, "w1"), (w2, "w2"), (w3, "w3"))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _compile(model: Path, tmp_path: Path, int8: dict, name: str = "m"):
    from services.repository import LocalModelRepository
    from services.storage import LocalArtifactStore

    spec = load_spec(
        {
            "targets": ["onnxruntime"],
            "precision": "int8",
            "name": name,
            "benchmark": False,
            "inputs": {"x": {"shape": [1, 4, 12, 12]}},
            "options": {"onnxruntime": {"int8": int8}},
        }
    )
    repo = tmp_path / "repo"
    result = compile_model(
        model, spec, store=LocalArtifactStore(tmp_path / "store"), repository=LocalModelRepository(repo)
    )
    return result.targets["onnxruntime"], repo / "triton" / name / "1"


def _nodes(path: Path) -> list[onnx.NodeProto]:
    return list(onnx.load(str(path)).graph.node)


def test_the_sensitive_node_fails_parity_without_exclusion(tmp_path: Path) -> None:
    t, _ = _compile(_sensitive_model(tmp_path / "s.onnx"), tmp_path, {"auto_exclude": False})
    assert t.status == "failed"
    assert t.error["code"] == "PARITY_FAILED"


def test_auto_exclude_leaves_the_sensitive_nodes_in_float_and_passes(tmp_path: Path) -> None:
    t, version = _compile(_sensitive_model(tmp_path / "s.onnx"), tmp_path, {})
    assert t.status == "succeeded", t.error
    manifest = json.loads((version / "kiln-manifest.json").read_text())
    auto = manifest["engine_details"]["int8"]["auto_exclude"]
    assert auto["needed"] is True
    assert auto["attempts"][0]["passed"] is False and auto["attempts"][-1]["passed"] is True
    # MinMax missed, so Percentile calibration was tried before any node was left in float.
    assert auto["attempts"][1]["tried"] == "Percentile calibration" and auto["attempts"][1]["excluded"] == 0
    assert [e["node"] for e in auto["left_in_float"]] == ["narrow_conv", "wide_conv"]
    assert manifest["parity"]["passed"] is True
    assert any("2 node(s) left in float" in w for w in manifest["warnings"])
    # The two sensitive Convs keep float weights; the ordinary ones are still int8.
    graph = {n.name: n for n in _nodes(version / "model.onnx")}
    dq_outputs = {o for n in graph.values() if n.op_type == "DequantizeLinear" for o in n.output}
    assert graph["wide_conv"].input[1] == "w1" and graph["narrow_conv"].input[1] == "w2"
    assert graph["first_conv"].input[1] in dq_outputs and graph["last_conv"].input[1] in dq_outputs


def _cnn(path: Path) -> Path:
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Sigmoid", ["c2"], ["y"], name="sig"),
    ]
    weights = [
        numpy_helper.from_array(rng.normal(size=(8, 4, 3, 3)).astype(np.float32) * 0.3, "w1"),
        numpy_helper.from_array(rng.normal(size=(8,)).astype(np.float32) * 0.1, "b1"),
        numpy_helper.from_array(rng.normal(size=(4, 8, 3, 3)).astype(np.float32) * 0.2, "w2"),
        numpy_helper.from_array(rng.normal(size=(4,)).astype(np.float32) * 0.1, "b2"),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 12, 12])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_options_reach_quantize_static(tmp_path: Path) -> None:
    from services.descriptors.onnxruntime import OnnxRuntimeInt8Options
    from services.exporters.ort_int8 import quantize_int8

    src = _cnn(tmp_path / "cnn.onnx")
    feeds = [{"x": np.random.default_rng(i).normal(size=(1, 4, 12, 12)).astype(np.float32)} for i in range(8)]

    qop = tmp_path / "qop.onnx"
    settings = quantize_int8(src, qop, feeds, tmp_path, OnnxRuntimeInt8Options(quant_format="qoperator"))
    ops = [n.op_type for n in _nodes(qop)]
    assert settings["format"] == "QOperator"
    assert ops.count("QLinearConv") == 2 and "DequantizeLinear" in ops and "Conv" not in ops

    excl = tmp_path / "excl.onnx"
    opts = OnnxRuntimeInt8Options(
        nodes_to_exclude=["conv2"], op_types_to_exclude=["Sigmoid"], calibrate_method="entropy"
    )
    settings = quantize_int8(src, excl, feeds, tmp_path, opts)
    graph = _nodes(excl)
    dq_out = {o for n in graph if n.op_type == "DequantizeLinear" for o in n.output}
    conv2 = next(n for n in graph if n.name == "conv2")
    conv1 = next(n for n in graph if n.name == "conv1")
    assert conv2.input[1] == "w2" and conv2.input[1] not in dq_out  # float weight, no QDQ around it
    assert conv1.input[1] in dq_out  # conv1 is still quantised
    assert settings["calibration_method"] == "Entropy" and settings["nodes_excluded"] == 2

    sym = tmp_path / "sym.onnx"
    settings = quantize_int8(
        src, sym, feeds, tmp_path, OnnxRuntimeInt8Options(activation_symmetric=True, per_channel=False)
    )
    model = onnx.load(str(sym))
    zero_points = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name.endswith("zero_point")}
    act_zp = [zp for name, zp in zero_points.items() if name.startswith(("x_", "r1_", "c1_"))]
    assert act_zp and all(zp.dtype == np.int8 and int(zp.max()) == 0 for zp in act_zp)
    assert settings["per_channel"] is False and settings["activations"] == "QInt8"


@pytest.mark.parametrize(
    "int8",
    [
        {"calibrate_method": "kl"},
        {"quant_format": "QLinear"},
        {"auto_exclude_rounds": 0},
        {"per_channel": "sometimes"},
        {"exclude_nodes": ["a"]},
    ],
)
def test_bad_int8_options_are_invalid_spec(int8: dict) -> None:
    with pytest.raises(InvalidSpec) as err:
        load_spec({"targets": ["onnxruntime"], "precision": "int8", "options": {"onnxruntime": {"int8": int8}}})
    assert err.value.code == "INVALID_SPEC"
