"""ncnn on transformers (issue 30, item 2): the ONNX rewrites that let pnnx lower transformers' exports.

The rewrites (services/exporters/ncnn_graph.py) are checked on small graphs built here, each
against onnxruntime on the original graph, and end to end: tiny Hugging Face checkpoints of
three families compiled by Kiln and run by ncnn's own Python API (not Kiln's runner) against
transformers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("ncnn", reason="the ncnn extra is not installed: pip install -c constraints.txt -e '.[ncnn]'")
pytest.importorskip("pnnx", reason="the ncnn extra is not installed: pip install -c constraints.txt -e '.[ncnn]'")

from kiln_testing import modern_matrix as mx
from kiln_testing import modern_models as mm
from services.exporters.ncnn_graph import rewrite_for_ncnn
from services.pipeline import compile_model
from services.spec import load_spec

L = 6


def _model(nodes: list, inputs: list, outputs: list, inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    types = {"tensor(float)": np.float32, "tensor(int64)": np.int64}
    return list(session.run(None, {i.name: feed[i.name].astype(types[i.type]) for i in session.get_inputs()}))


def _rewritten(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    report = rewrite_for_ncnn(copy)
    onnx.checker.check_model(copy, full_check=True)
    return copy, report.counts


def test_a_padding_mask_becomes_float_arithmetic_on_a_float_input() -> None:
    """transformers' eager mask: attention_mask[batch, kv] (a GatherND), & causal, where(mask, 0, min)."""
    causal = np.tril(np.ones((L, L), bool))[None, None]
    kv = np.stack(np.meshgrid(np.zeros(1, np.int64), np.arange(L), indexing="ij"), -1).reshape(1, 1, 1, L, 2)
    model = _model(
        [
            helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.BOOL),
            helper.make_node("GatherND", ["m", "kv"], ["pad"]),
            helper.make_node("And", ["causal", "pad"], ["both"]),
            helper.make_node("Where", ["both", "zero", "min"], ["bias"]),
            helper.make_node("Add", ["scores", "bias"], ["s"]),
            helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        ],
        [
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, L]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 2, L, L]),
        ],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 2, L, L])],
        {"kv": kv, "causal": causal, "zero": np.array(0, np.float32), "min": np.array(-np.inf, np.float32)},
    )
    rng = np.random.default_rng(0)
    feed = {"attention_mask": np.array([[1, 1, 1, 1, 0, 0]]), "scores": rng.standard_normal((1, 2, L, L))}
    new, counts = _rewritten(model)
    ops = {n.op_type for n in new.graph.node}
    assert not ops & {"Cast", "GatherND", "And", "Where"}, ops
    assert new.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT  # ncnn feeds it as float32
    assert counts["where() as c*x + (1-c)*y"] == 1
    np.testing.assert_allclose(_run(new, feed)[0], _run(model, feed)[0], atol=1e-7)
    # The -inf branch is clipped to float32's largest magnitude: 0 * inf would be NaN.
    assert np.isfinite(_run(new, feed)[0]).all()


def test_deberta_relative_position_gathers_become_a_nearest_grid_sample() -> None:
    rng = np.random.default_rng(1)
    span = 8
    rel = np.arange(L)[:, None] - np.arange(L)[None, :]
    bucket = np.sign(rel) * np.minimum(np.abs(rel) ** 2, span - 1) + span  # not an affine map
    idx = np.broadcast_to(bucket, (3, L, L)).astype(np.int64)
    model = _model(
        [helper.make_node("GatherElements", ["scores", "idx"], ["out"], axis=-1)],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [3, L, 2 * span])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3, L, L])],
        {"idx": idx},
    )
    new, counts = _rewritten(model)
    assert [n.op_type for n in new.graph.node] == ["Reshape", "GridSample", "Reshape"]
    feed = {"scores": rng.standard_normal((3, L, 2 * span))}
    np.testing.assert_array_equal(_run(new, feed)[0], _run(model, feed)[0])
    assert counts == {"constant-index row gather as nearest GridSample": 1}


def test_window_partitions_strided_slices_reductions_and_cubes_fit_ncnn() -> None:
    """Swin's 6-D window partition and 0::2 patch merging, a one-axis mean, the tanh GELU's cube."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 8, 4])
    nodes = [
        helper.make_node("Reshape", ["x", "six"], ["w6"]),
        helper.make_node("Transpose", ["w6"], ["t6"], perm=[0, 1, 3, 2, 4, 5]),
        helper.make_node("Reshape", ["t6", "four"], ["win"]),
        helper.make_node("Slice", ["x", "s0", "e0", "a1", "two"], ["even"]),
        helper.make_node("ReduceMean", ["win", "a1"], ["mean"], keepdims=0),
        helper.make_node("ReduceMean", ["even", "last"], ["heads"], keepdims=1),
        helper.make_node("Pow", ["mean", "three"], ["cube"]),
    ]
    inits = {
        "six": np.array([1, 2, 4, 2, 4, 4], np.int64),
        "four": np.array([4, 16, 4], np.int64),
        "s0": np.array([1], np.int64),
        "e0": np.array([2**62], np.int64),
        "a1": np.array([1], np.int64),
        "two": np.array([2], np.int64),
        "three": np.array(3.0, np.float32),
        "last": np.array([-1], np.int64),
    }
    outs = [
        helper.make_tensor_value_info("win", TensorProto.FLOAT, [4, 16, 4]),
        helper.make_tensor_value_info("cube", TensorProto.FLOAT, [4, 4]),
        helper.make_tensor_value_info("even", TensorProto.FLOAT, [1, 4, 8, 4]),
        helper.make_tensor_value_info("heads", TensorProto.FLOAT, [1, 4, 8, 1]),
    ]
    model = _model(nodes, [x], outs, inits)
    new, counts = _rewritten(model)
    assert counts["strided Slice as reshape + slice"] == 1 and counts["integer power as products"] == 1
    # Qwen3's q/k norms reduce a 4-D [1, seq, heads, dim] tensor: that one too.
    assert counts["one-axis reduction over two axes (pnnx's list form)"] == 2
    assert counts["Transpose of > 4 axes merged"] == 1
    inferred = onnx.shape_inference.infer_shapes(new)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info}
    # ncnn holds 4 axes per sample: 5 with a leading batch axis of one.
    too_many = {k: s for k, s in shapes.items() if len(s) > 5 or (len(s) == 5 and s[0] != 1)}
    assert not too_many, too_many
    assert "Pow" not in {n.op_type for n in new.graph.node}
    feed = {"x": np.random.default_rng(2).standard_normal((1, 8, 8, 4)) - 0.5}
    for got, want in zip(_run(new, feed), _run(model, feed), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("key", ["qwen3", "deberta-v2", "swin"])
def test_transformers_checkpoints_compile_to_ncnn_and_agree_on_ncnn_itself(
    key: str, ncnn_store, repository, tmp_path: Path
) -> None:
    """GQA decoder with q/k norms (embedding, masks, RMSNorm over heads), DeBERTa (relative positions), Swin (windows): published and,
    run by ncnn's own Python API with the sidecar's blobs, equal to transformers."""
    fam = mm.family(key)
    src = mm.build_checkpoint(fam, tmp_path)
    spec = load_spec(
        {
            "targets": ["ncnn"],
            "name": key,
            "benchmark": False,
            "validation": {"samples": 2},
            "options": {"huggingface": {"task": fam.task}},
        }
    )
    result = compile_model(src, spec, store=ncnn_store, repository=repository)
    target = result.targets["ncnn"]
    assert target.status == "succeeded", target.error
    version = Path(target.published["uri"].removeprefix("file://"))
    check = mx.check_artifact(fam, src, mx.open_artifact("ncnn", version))
    assert check["ok"], check
    assert check["max_rel"] < 1e-4
    rewrites = result.steps["export:ncnn"].meta["engine_details"]["ncnn"]["onnx_rewrites"]
    assert any(note.startswith("rewritten for ncnn") for note in rewrites)


@pytest.fixture(scope="module")
def ncnn_store(tmp_path_factory: pytest.TempPathFactory):
    from services.storage import LocalArtifactStore

    return LocalArtifactStore(tmp_path_factory.mktemp("ncnn-transformers-store"))
