"""precision int4: weight-only MatMul compression on onnxruntime (MatMulNBits) and OpenVINO (NNCF)."""

from __future__ import annotations

import json
import os
import subprocess
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from jobs_support import KILN_CMD
from onnx import helper, numpy_helper

from kiln_testing.models import tiny_gpt2_onnx
from services.errors import NoRoute
from services.formats import Format
from services.graph.planner import plan_routes
from services.pipeline import compile_model
from services.spec import DEFAULT_TOLERANCES, Precision, load_spec

INT4 = DEFAULT_TOLERANCES[Precision.INT4]


@pytest.fixture(scope="module")
def gpt2_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gpt2_onnx(tmp_path_factory.mktemp("gpt2") / "gpt2.onnx")


def _ir_const_types(xml: Path) -> Counter[str]:
    consts: Counter[str] = Counter()
    for layer in ET.parse(xml).getroot().iter("layer"):
        if layer.get("type") == "Const":
            consts[layer.find("data").get("element_type", "")] += 1
    return consts


def test_kiln_compile_int4_gpt2_on_both_targets(gpt2_onnx: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    args = [*KILN_CMD, "compile", str(gpt2_onnx), "-t", "onnxruntime", "-t", "openvino", "--precision", "int4"]
    args += ["--repo", str(repo), "--name", "lm", "--no-benchmark", "--json", "--cache-dir", str(tmp_path / "cache")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    for target in ("onnxruntime", "openvino"):
        t = result["targets"][target]
        assert t["status"] == "succeeded" and t["parity"]["passed"], t
        (logits,) = t["parity"]["outputs"]
        # Inside the default, and as close as measured on this model (0.994 / 0.997), yet really changed.
        assert max(INT4.min_cosine, 0.98) <= logits["cosine"] < 0.99999, logits
        assert logits["max_abs"] > 1e-4

    ort_dir = repo / "triton" / "lm-onnxruntime" / "1"
    manifest = json.loads((ort_dir / "kiln-manifest.json").read_text())
    assert manifest["precision"] == "int4"
    details = manifest["engine_details"]["int4"]
    assert details["block_size"] == 32 and details["bits"] == 4
    artifact = onnx.load(str(ort_dir / "model.onnx"))
    nbits = [n for n in artifact.graph.node if n.op_type == "MatMulNBits"]
    # 2 layers x (qkv, attention out, MLP in, MLP out) + the LM head: every projection is int4.
    assert len(nbits) == details["quantized_matmuls"] == 9
    assert details["gemms_split_to_matmul"] == 8
    # The token embedding table is GatherBlockQuantized int4 (the position embedding's Gather
    # of a static 0..15 range is folded away by the optimiser).
    assert sum(n.op_type == "GatherBlockQuantized" for n in artifact.graph.node) == details["quantized_gathers"] == 1
    assert not any(n.op_type == "Gemm" for n in artifact.graph.node)
    fp32_size = gpt2_onnx.stat().st_size
    assert (ort_dir / "model.onnx").stat().st_size < 0.3 * fp32_size

    ov_dir = repo / "triton" / "lm-openvino" / "1"
    manifest = json.loads((ov_dir / "kiln-manifest.json").read_text())
    assert manifest["precision"] == "int4"
    details = manifest["engine_details"]["int4"]
    assert details["mode"] == "INT4_SYM" and details["group_size"] == 32
    consts = _ir_const_types(ov_dir / "model.xml")
    assert consts["i4"] + consts["u4"] == details["int4_weight_constants"] >= 8  # the 8 layer projections
    assert (ov_dir / "model.bin").stat().st_size < 0.5 * fp32_size
    # The IR's input keeps the source's name (its port also carries an exporter alias that sorts first).
    assert [i["name"] for i in manifest["io"]["inputs"]] == ["input_ids"]
    assert 'name: "input_ids"' in (ov_dir.parent / "config.pbtxt").read_text()


@pytest.mark.parametrize("target", ["onnxruntime", "openvino"])
def test_int4_of_a_model_without_eligible_matmuls_is_refused(target: str, cnn_onnx: Path, store, repository) -> None:
    # The CNN's only MatMul-like op is a 16-input Gemm (16 does not divide into blocks of 32):
    # nothing could be int4, and an "int4" artifact of fp32 weights would be a false label.
    spec = load_spec({"targets": [target], "precision": "int4", "name": "m", "benchmark": {"enabled": False}})
    result = compile_model(cnn_onnx, spec, store=store, repository=repository)
    t = result.targets[target]
    assert t.status == "failed" and t.published is None
    assert t.error["code"] == "CONVERSION_FAILED"
    assert "int4" in t.error["message"] and "32" in t.error["message"]
    assert "fp32, fp16 or int8" in t.error["hint"]


@pytest.mark.parametrize("target", ["tflite", "tfserving", "tensorrt"])
def test_targets_without_int4_are_refused_at_planning(target: str) -> None:
    spec = load_spec({"targets": [target], "precision": "int4"})
    source = Format.KERAS if target in ("tflite", "tfserving") else Format.ONNX
    with pytest.raises(NoRoute) as exc:
        plan_routes(source, spec)
    err = exc.value
    assert err.code == "NO_ROUTE"
    assert f"to {target} at int4" in str(err)
    assert "Kiln can build: onnxruntime, openvino." in err.hint
    assert f"{target} from this source is possible at: fp16, fp32, int8" in err.hint


def test_split_constant_gemm_is_exact(tmp_path: Path) -> None:
    from services.exporters.onnx_int4 import split_constant_gemms

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)  # [N, K]: transB
    b = rng.standard_normal(8).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 8])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((3, 64)).astype(np.float32)
    before = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert split_constant_gemms(model) == 1
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Add"]
    assert [i.name for i in model.graph.initializer] == ["b", "w_kiln_kn_0"]  # the [N, K] copy dropped
    after = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)
