"""Kiln's ONNX passes: each one on a tiny graph, node counts and onnxruntime outputs before/after.

Graphs are built with onnx.helper in the test; each check runs the graph in onnxruntime
before and after the pass on the same seeded inputs and asserts the outputs agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from services.artifacts import Artifact
from services.errors import ConversionFailed
from services.formats import DetectedSource, Format
from services.graph.planner import PlanStep
from services.passes import (
    KilnPass,
    OutputCheck,
    PassManager,
    PassResult,
    default_passes,
    optimize_model,
    speed,
)
from services.passes.elimination import CommonSubexpressions, DeadCode, EliminateNoOps, IdentityElimination
from services.passes.folding import ConstantFolding, ShapeInference
from services.passes.fusion import FuseBatchNorm, FuseConvAffine, FuseMatMulAddToGemm, FusePadIntoConv
from services.passes.slices import MergeSlicesIntoSplit
from services.passes.step import run_optimize_step, speed_guard
from services.passes.verify import compare_arrays, ort_session
from services.spec import CompileSpec
from services.steps.context import StepContext

OPSET = 17
RNG = np.random.default_rng(0)


def make_model(
    nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: Any = (), opset: int = OPSET
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def const(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(np.asarray(array), name=name)


def f32(name: str, shape: list[Any]) -> Any:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def feeds_for(model: onnx.ModelProto, **dims: int) -> dict[str, np.ndarray]:
    feeds = {}
    rng = np.random.default_rng(1)
    for inp in model.graph.input:
        shape = [
            d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param, 2) for d in inp.type.tensor_type.shape.dim
        ]
        feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort_session(model)
    return session.run(None, feeds)


def assert_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, rtol: float = 1e-5, **dims: int) -> None:
    feeds = feeds_for(before, **dims)
    want, got = run(before, feeds), run(after, feeds)
    assert len(want) == len(got)
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * float(np.abs(w).max()))


def apply(model: onnx.ModelProto, *passes: KilnPass) -> tuple[onnx.ModelProto, list[Any]]:
    """Run ``passes`` through the manager; return the new proto and the records."""
    ir_model = ir.serde.deserialize_model(model)
    records = PassManager(list(passes)).run(ir_model)
    return ir.serde.serialize_model(ir_model), records


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


# --- Conv + BatchNormalization ------------------------------------------------------


def conv_bn_model(*, conv_out_is_output: bool = False) -> onnx.ModelProto:
    w = RNG.standard_normal((8, 3, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(8).astype(np.float32)
    scale = RNG.uniform(0.5, 1.5, 8).astype(np.float32)
    bias = RNG.uniform(-0.5, 0.5, 8).astype(np.float32)
    mean = RNG.uniform(-1.0, 1.0, 8).astype(np.float32)
    var = RNG.uniform(0.2, 3.0, 8).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["n"], epsilon=1e-3),
        helper.make_node("Relu", ["n"], ["y"]),
    ]
    outputs = [f32("y", ["N", 8, 8, 8])] + ([f32("c", ["N", 8, 8, 8])] if conv_out_is_output else [])
    inits = [
        const("w", w),
        const("b", b),
        const("scale", scale),
        const("bias", bias),
        const("mean", mean),
        const("var", var),
    ]
    return make_model(nodes, [f32("x", ["N", 3, 8, 8])], outputs, inits)


def test_conv_batchnorm_is_folded_into_the_conv_weights() -> None:
    model = conv_bn_model()
    out, records = apply(model, ShapeInference(), FuseBatchNorm())
    assert op_types(model) == ["Conv", "BatchNormalization", "Relu"]
    assert op_types(out) == ["Conv", "Relu"]
    rec = records[-1]
    assert (rec.name, rec.nodes_before, rec.nodes_after, rec.modified) == ("fuse_batchnorm", 3, 2, True)
    # Non-trivial statistics: the fused weights differ from the originals, results do not.
    fused_w = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    assert not any(
        np.allclose(v, numpy_helper.to_array(model.graph.initializer[0]))
        for v in fused_w.values()
        if v.shape == (8, 3, 3, 3)
    )
    assert_same_outputs(model, out, N=3)


def test_batchnorm_stays_when_the_conv_output_is_also_read_elsewhere() -> None:
    model = conv_bn_model(conv_out_is_output=True)
    out, records = apply(model, ShapeInference(), FuseBatchNorm())
    assert "BatchNormalization" in op_types(out)
    assert records[-1].modified is False
    assert_same_outputs(model, out)


def test_batchnorm_from_torch_exporter_is_folded(tmp_path: Path) -> None:
    """The TorchScript exporter with training=PRESERVE keeps BatchNormalization unfused."""
    import torch

    from kiln_testing.models import tiny_cnn_module

    path = tmp_path / "cnn_bn.onnx"
    torch.onnx.export(
        tiny_cnn_module(),
        (torch.randn(1, 3, 32, 32),),
        str(path),
        input_names=["input"],
        output_names=["output"],
        dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        opset_version=OPSET,
        dynamo=False,
        training=torch.onnx.TrainingMode.PRESERVE,
        do_constant_folding=False,
    )
    model = onnx.load(str(path))
    assert op_types(model).count("BatchNormalization") == 2
    out, report = optimize_model(model)
    assert "BatchNormalization" not in op_types(out)
    fused = next(r for r in report.passes if r.name == "fuse_batchnorm")
    assert fused.nodes_before - fused.nodes_after == 2
    assert_same_outputs(model, out, batch=4)


# --- MatMul + Add -> Gemm ----------------------------------------------------------------


def matmul_add_model(
    c_shape: list[int], a_shape: list[Any], y_shape: list[Any], *, bias_first: bool = False
) -> onnx.ModelProto:
    k, n = a_shape[-1], 6
    w = RNG.standard_normal((k, n)).astype(np.float32)
    c = RNG.standard_normal(c_shape).astype(np.float32)
    add_inputs = ["c", "mm"] if bias_first else ["mm", "c"]
    nodes = [helper.make_node("MatMul", ["a", "w"], ["mm"]), helper.make_node("Add", add_inputs, ["y"])]
    return make_model(nodes, [f32("a", a_shape)], [f32("y", y_shape)], [const("w", w), const("c", c)])


@pytest.mark.parametrize("bias_first", [False, True])
def test_matmul_add_becomes_gemm(bias_first: bool) -> None:
    model = matmul_add_model([6], ["M", 5], ["M", 6], bias_first=bias_first)
    out, records = apply(model, ShapeInference(), FuseMatMulAddToGemm())
    assert op_types(out) == ["Gemm"]
    assert (records[-1].nodes_before, records[-1].nodes_after) == (2, 1)
    assert_same_outputs(model, out, M=7)


@pytest.mark.parametrize(
    ("c_shape", "a_shape", "y_shape"),
    [([4, 6], [1, 5], [4, 6]), ([2, 1, 6], [3, 5], [2, 3, 6]), ([6], [2, 3, 5], [2, 3, 6])],
    ids=["c-widens-the-product", "c-adds-a-rank", "rank-3-matmul"],
)
def test_matmul_add_stays_when_gemm_would_differ(c_shape: list[int], a_shape: list[int], y_shape: list[int]) -> None:
    model = matmul_add_model(c_shape, a_shape, y_shape)
    out, records = apply(model, ShapeInference(), FuseMatMulAddToGemm())
    assert op_types(out) == ["MatMul", "Add"]
    assert records[-1].modified is False
    assert_same_outputs(model, out)


# --- folding -------------------------------------------------------------------------


def test_constant_folding_evaluates_constant_subexpressions() -> None:
    nodes = [
        helper.make_node("Constant", [], ["k"], value=const("kv", np.array([2.0, 3.0, 4.0], np.float32))),
        helper.make_node("Mul", ["k", "w"], ["kw"]),
        helper.make_node("Sqrt", ["kw"], ["s"]),
        helper.make_node("Add", ["x", "s"], ["y"]),
    ]
    model = make_model(
        nodes, [f32("x", [2, 3])], [f32("y", [2, 3])], [const("w", np.array([1.0, 5.0, 9.0], np.float32))]
    )
    out, records = apply(model, ConstantFolding(), DeadCode())
    assert op_types(out) == ["Add"]
    assert records[0].modified and records[0].nodes_after < records[0].nodes_before
    assert_same_outputs(model, out)


def test_folded_transposed_weights_are_stored_plainly_and_deduplicated() -> None:
    """Folding Transpose(W) leaves a numpy view; the initializer passes after it must cope."""
    w = RNG.standard_normal((6, 5)).astype(np.float32)
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["a"]),
        helper.make_node("Transpose", ["w2"], ["wt2"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt2"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    model = make_model(nodes, [f32("x", [3, 5])], [f32("y", [3, 6])], [const("w", w), const("w2", w.copy())])
    out, report = optimize_model(model)
    assert "Transpose" not in op_types(out)
    assert len(out.graph.initializer) == 1  # the two equal weights became one
    assert next(r for r in report.passes if r.name == "deduplicate_initializers").modified
    assert_same_outputs(model, out)


def reshape_by_dims_model() -> onnx.ModelProto:
    """What torch emits for x.view(x.size(0), x.size(1), 2, x.size(2) // 2): Shape/Gather/Div/Concat."""
    i64 = lambda name, v: const(name, np.array(v, np.int64))  # noqa: E731
    nodes = [helper.make_node("Shape", ["x"], ["s"])]
    for k in range(3):
        nodes.append(helper.make_node("Gather", ["s", f"i{k}"], [f"d{k}"], axis=0))
    nodes += [
        helper.make_node("Div", ["d2", "two"], ["half"]),
        helper.make_node("Unsqueeze", ["d0", "ax"], ["u0"]),
        helper.make_node("Unsqueeze", ["d1", "ax"], ["u1"]),
        helper.make_node("Unsqueeze", ["half", "ax"], ["u3"]),
        helper.make_node("Concat", ["u0", "u1", "two1", "u3"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    inits = [i64("i0", 0), i64("i1", 1), i64("i2", 2), i64("two", 2), i64("ax", [0]), i64("two1", [2])]
    return make_model(nodes, [f32("x", ["batch", 4, 6])], [f32("y", ["batch", 4, 2, 3])], inits)


def test_static_dims_fold_and_the_batch_stays_dynamic() -> None:
    model = reshape_by_dims_model()
    out, report = optimize_model(model)
    assert "Shape" not in op_types(out) and "Gather" not in op_types(out)
    assert op_types(out) == ["Reshape"]
    assert (report.nodes_before, report.nodes_after) == (len(model.graph.node), 1)
    for batch in (1, 5):
        assert_same_outputs(model, out, batch=batch)


# --- elimination ---------------------------------------------------------------------


def test_identity_chains_and_dead_branches_go_and_output_names_stay() -> None:
    nodes = [
        helper.make_node("Identity", ["x"], ["i1"]),
        helper.make_node("Relu", ["i1"], ["r"]),
        helper.make_node("Identity", ["r"], ["i2"]),
        helper.make_node("Identity", ["i2"], ["y"]),
        helper.make_node("Sigmoid", ["x"], ["unused"]),
    ]
    model = make_model(nodes, [f32("x", [3, 4])], [f32("y", [3, 4])])
    out, records = apply(model, IdentityElimination(), DeadCode())
    assert op_types(out) == ["Relu"]
    assert [o.name for o in out.graph.output] == ["y"] and [i.name for i in out.graph.input] == ["x"]
    assert [(r.nodes_before, r.nodes_after) for r in records] == [(5, 2), (2, 1)]
    assert_same_outputs(model, out)


def test_common_subexpressions_are_computed_once() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Relu", ["x"], ["b"]),
        helper.make_node("Mul", ["a", "b"], ["y"]),
    ]
    model = make_model(nodes, [f32("x", [3, 4])], [f32("y", [3, 4])])
    out, records = apply(model, CommonSubexpressions(), DeadCode())
    assert op_types(out) == ["Relu", "Mul"]
    assert records[0].modified
    assert_same_outputs(model, out)


def test_neutral_elements_are_dropped_unless_broadcasting_changes_the_shape() -> None:
    nodes = [
        helper.make_node("Mul", ["x", "one"], ["m"]),
        helper.make_node("Add", ["zero", "m"], ["a"]),
        helper.make_node("Relu", ["a"], ["y"]),
        # x[2,1] + zeros[3] is [2,3]: not a no-op.
        helper.make_node("Add", ["col", "zeros3"], ["z"]),
    ]
    inits = [
        const("one", np.float32(1.0)),
        const("zero", np.zeros([1], np.float32)),
        const("zeros3", np.zeros([3], np.float32)),
    ]
    model = make_model(nodes, [f32("x", [2, 4]), f32("col", [2, 1])], [f32("y", [2, 4]), f32("z", [2, 3])], inits)
    out, _ = apply(model, ShapeInference(), EliminateNoOps(), IdentityElimination(), DeadCode())
    assert op_types(out) == ["Relu", "Add"]
    assert_same_outputs(model, out)


def test_cast_chains_that_round_twice_are_kept() -> None:
    nodes = [
        helper.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["f"], ["y"], to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["h"], ["g"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["g"], ["z"], to=TensorProto.FLOAT16),
    ]
    model = make_model(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, [64]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT16, [4]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT16, [64]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT16, [4]),
        ],
    )
    out, _ = apply(model, ShapeInference(), EliminateNoOps(), IdentityElimination(), DeadCode())
    # double -> float -> half rounds twice and stays; half -> float -> half is exact and goes
    # (down to the Identity that keeps graph input h and graph output z apart).
    assert op_types(out) == ["Cast", "Cast", "Identity"]
    x = np.float64(1.0) + np.arange(64) * 2.0**-11 + 2.0**-35  # values near half-way points
    h = np.array([0.5, -2.0, 65504.0, 1e-4], np.float16)
    want, got = ort_session(model).run(None, {"x": x, "h": h}), ort_session(out).run(None, {"x": x, "h": h})
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    ("scale_shape", "fused"),
    [([1, 4, 1, 1], True), ([4, 1, 1], True), ([], True), ([1, 1, 1, 5], False)],
    ids=["per-channel", "per-channel-rank3", "scalar", "per-column"],
)
def test_per_channel_mul_and_add_after_conv_fold_into_its_weights(scale_shape: list[int], fused: bool) -> None:
    """tf2onnx leaves BatchNorm after a depthwise conv as Mul + Add with per-channel constants."""
    w = RNG.standard_normal((4, 1, 3, 3)).astype(np.float32)
    s = RNG.uniform(0.5, 2.0, scale_shape).astype(np.float32)
    a = RNG.uniform(-1.0, 1.0, scale_shape).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], group=4, pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["c", "s"], ["m"]),
        helper.make_node("Add", ["a", "m"], ["y"]),
    ]
    model = make_model(
        nodes, [f32("x", ["N", 4, 5, 5])], [f32("y", ["N", 4, 5, 5])], [const("w", w), const("s", s), const("a", a)]
    )
    out, records = apply(model, ShapeInference(), FuseConvAffine(), DeadCode())
    assert op_types(out) == (["Conv"] if fused else ["Conv", "Mul", "Add"])
    assert records[1].modified is fused
    assert_same_outputs(model, out, N=2)


def test_zero_pad_is_folded_into_the_conv() -> None:
    w = RNG.standard_normal((4, 2, 3, 3)).astype(np.float32)
    pads = np.array([0, 0, 1, 2, 0, 0, 1, 2], np.int64)
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["p"], mode="constant"),
        helper.make_node("Conv", ["p", "w"], ["y"]),
    ]
    model = make_model(nodes, [f32("x", [1, 2, 6, 6])], [f32("y", [1, 4, 6, 8])], [const("w", w), const("pads", pads)])
    out, _ = apply(model, ShapeInference(), FusePadIntoConv(), DeadCode())
    assert op_types(out) == ["Conv"]
    assert list(helper.get_attribute_value(out.graph.node[0].attribute[0])) == [1, 2, 1, 2]
    assert_same_outputs(model, out)


def slices_model(bounds: list[tuple[int, int]], axis: int = -1) -> onnx.ModelProto:
    nodes, inits, outputs = [], [], []
    for i, (start, end) in enumerate(bounds):
        inits += [
            const(f"s{i}", np.array([start], np.int64)),
            const(f"e{i}", np.array([end], np.int64)),
            const(f"a{i}", np.array([axis], np.int64)),
        ]
        nodes += [
            helper.make_node("Slice", ["h", f"s{i}", f"e{i}", f"a{i}"], [f"p{i}"]),
            helper.make_node("Relu", [f"p{i}"], [f"y{i}"]),
        ]
        outputs.append(f32(f"y{i}", [2, end - start]))
    nodes.insert(0, helper.make_node("Sigmoid", ["x"], ["h"]))
    return make_model(nodes, [f32("x", [2, 7])], outputs, inits)


@pytest.mark.parametrize(
    ("bounds", "merged"),
    [
        ([(0, 3), (3, 5), (5, 7)], True),  # uneven pieces, in order
        ([(4, 7), (0, 4)], True),  # out of order, still tiling
        ([(0, 3), (4, 7)], False),  # a gap
        ([(0, 4), (3, 7)], False),  # an overlap
    ],
    ids=["three-uneven", "out-of-order", "gap", "overlap"],
)
def test_slices_that_tile_an_axis_become_one_split(bounds: list[tuple[int, int]], merged: bool) -> None:
    model = slices_model(bounds)
    out, records = apply(model, ShapeInference(), MergeSlicesIntoSplit(), DeadCode())
    ops = op_types(out)
    assert ops.count("Split") == (1 if merged else 0)
    assert ops.count("Slice") == (0 if merged else len(bounds))
    assert records[1].modified is merged
    assert [o.name for o in out.graph.output] == [o.name for o in model.graph.output]
    assert_same_outputs(model, out)


# --- the manager ----------------------------------------------------------------------


class Boom(KilnPass):
    name = "boom"

    def call(self, model: ir.Model) -> PassResult:
        raise ValueError("kaboom")


class RenameOutput(KilnPass):
    name = "rename_output"

    def call(self, model: ir.Model) -> PassResult:
        model.graph.outputs[0].name = "renamed"
        return PassResult(model, True)


class DoubleTheBias(KilnPass):
    """A broken 'optimisation': doubles every bias vector (changes results)."""

    name = "double_bias"

    def call(self, model: ir.Model) -> PassResult:
        for init in model.graph.initializers.values():
            if init.const_value is not None and init.const_value.numpy().ndim == 1:
                init.const_value = ir.tensor(init.const_value.numpy() * 2, name=init.name)
        return PassResult(model, True)


def test_a_failing_pass_is_conversion_failed_naming_it_and_the_passes_before() -> None:
    model = conv_bn_model()
    with pytest.raises(ConversionFailed) as err:
        optimize_model(model, [ShapeInference(), FuseBatchNorm(), Boom(), DeadCode()])
    exc = err.value
    assert exc.code == "CONVERSION_FAILED"
    assert exc.details["pass"] == "boom"
    assert exc.details["passes_before"] == ["shape_inference", "fuse_batchnorm"]
    assert "'boom'" in exc.message and "kaboom" in exc.message
    assert "ValueError" in exc.details["output_tail"]


def test_a_pass_that_changes_the_signature_breaks_its_contract() -> None:
    with pytest.raises(ConversionFailed) as err:
        optimize_model(conv_bn_model(), [RenameOutput()])
    assert err.value.details["pass"] == "rename_output"
    assert "contract" in err.value.message and "renamed" in err.value.message


class BogusRelu(KilnPass):
    """Adds a Relu with two inputs: the signature is intact, onnx.checker is not."""

    name = "bogus_relu"

    def call(self, model: ir.Model) -> PassResult:
        x = model.graph.inputs[0]
        model.graph.append(ir.node("Relu", [x, x], name="bogus"))
        return PassResult(model, True)


def test_a_pass_that_makes_the_model_invalid_is_named() -> None:
    with pytest.raises(ConversionFailed) as err:
        optimize_model(conv_bn_model(), [ShapeInference(), BogusRelu(), FuseBatchNorm()])
    assert err.value.details["pass"] == "bogus_relu"
    assert err.value.details["passes_before"] == ["shape_inference"]
    assert "onnx.checker" in err.value.message


def test_pass_names_must_be_unique() -> None:
    with pytest.raises(ValueError, match="twice"):
        PassManager([DeadCode(), DeadCode()])


def test_the_safety_net_reverts_the_pass_that_changes_outputs_and_keeps_the_rest() -> None:
    model = conv_bn_model()
    feeds = [feeds_for(model, N=2)]
    check = OutputCheck.for_model(model, feeds)
    out, report = optimize_model(model, [ShapeInference(), FuseBatchNorm(), DoubleTheBias(), DeadCode()], check=check)
    assert report.reverted == ["double_bias"]
    bad = next(r for r in report.passes if r.name == "double_bias")
    assert bad.reverted and "beyond" in (bad.reason or "")
    assert report.verification is not None and report.verification["reverted"] == ["double_bias"]
    # The good fusion survived; the result matches the source.
    assert op_types(out) == ["Conv", "Relu"]
    assert check.compare(out) is None
    assert_same_outputs(model, out, N=2)


def test_optimize_model_leaves_its_input_alone_and_records_every_pass() -> None:
    model = conv_bn_model()
    before = model.SerializeToString()
    out, report = optimize_model(model)
    assert model.SerializeToString() == before
    assert [r.name for r in report.passes] == [p.name for p in default_passes()]
    for rec in report.passes:
        assert set(rec.to_dict()) >= {"name", "nodes_before", "nodes_after", "seconds", "modified"}
        assert rec.seconds >= 0
    assert (report.nodes_before, report.nodes_after) == (3, 2)
    onnx.checker.check_model(out)


def test_compare_arrays_is_relative_to_the_output_scale() -> None:
    e = np.array([1000.0, 1.0, 0.0], np.float32)
    assert compare_arrays(e + np.float32(1e-3), e) is None  # 1e-6 of the scale
    assert compare_arrays(e + np.array([0, 0, 0.1], np.float32), e) is not None
    assert compare_arrays(np.array([1, 2]), np.array([1, 3])) is not None  # integers: exact
    assert compare_arrays(np.array([np.nan]), np.array([1.0])) == "NaN positions differ"


# --- the optimize step ------------------------------------------------------------------


def step_context(tmp_path: Path, model_path: Path, spec: CompileSpec | None = None) -> StepContext:
    spec = spec or CompileSpec(targets=["onnxruntime"])
    step = PlanStep(
        id="optimize",
        kind="optimize",
        engine="onnxruntime",
        entry="services.passes.step:run_optimize_step",
        inputs={"model": "source"},
        tool="kiln passes",
        format_out="onnx",
    )
    source = DetectedSource(format=Format.ONNX, path=model_path, seen="onnx", sha256="0" * 64)
    out_dir, scratch = tmp_path / "out", tmp_path / "scratch"
    out_dir.mkdir()
    scratch.mkdir()
    model_art = Artifact(root=model_path.parent, kind="onnx", entry=model_path.name)
    return StepContext(
        job_id="j", step=step, spec=spec, source=source, inputs={"model": model_art}, out_dir=out_dir, scratch=scratch
    )


def test_optimize_step_writes_a_smaller_verified_transformer(tmp_path: Path, transformer_onnx: Path) -> None:
    art = run_optimize_step(step_context(tmp_path, transformer_onnx))
    assert art.kind == "onnx" and art.entry == "model.onnx" and art.path.is_file()
    meta = art.meta
    assert [p["name"] for p in meta["passes"]] == [p.name for p in default_passes()]
    assert meta["nodes_before"] == len(onnx.load(str(transformer_onnx)).graph.node)
    assert meta["nodes_after"] < meta["nodes_before"] // 2
    assert meta["verification"]["checked"] is True and meta["verification"]["reverted"] == []
    # Dynamic batch survives the shape folding.
    source, optimised = onnx.load(str(transformer_onnx)), onnx.load(str(art.path))
    assert_same_outputs(source, optimised, batch=3)


def test_optimize_step_on_the_cnn(tmp_path: Path, cnn_onnx: Path) -> None:
    art = run_optimize_step(step_context(tmp_path, cnn_onnx))
    assert art.meta["verification"]["checked"] is True
    assert art.meta["nodes_after"] <= art.meta["nodes_before"]
    assert_same_outputs(onnx.load(str(cnn_onnx)), onnx.load(str(art.path)), batch=2)


# --- what onnxruntime sees after the optimiser (issue 12) -------------------------------


def ort_optimized_op_types(model: onnx.ModelProto, tmp_path: Path) -> list[str]:
    """Return the op types of ``model`` after onnxruntime's own load-time rewrites (ORT_ENABLE_ALL)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "ort_optimized.onnx")
    opts.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return op_types(onnx.load(opts.optimized_model_filepath))


def residual_layernorm_model(d: int = 8) -> onnx.ModelProto:
    """BERT's attention output: heads merged back by a Reshape to a computed shape, a dense
    layer, the residual Add and LayerNormalization; batch and sequence dynamic."""
    nodes = [
        helper.make_node("Shape", ["x"], ["bs"], start=0, end=2),
        helper.make_node("Concat", ["bs", "heads"], ["split_shape"], axis=0),
        helper.make_node("Reshape", ["x", "split_shape"], ["split"]),
        helper.make_node("Transpose", ["split"], ["per_head"], perm=[0, 2, 1, 3]),
        helper.make_node("Relu", ["per_head"], ["act"]),
        helper.make_node("Transpose", ["act"], ["back"], perm=[0, 2, 1, 3]),
        helper.make_node("Concat", ["bs", "width"], ["merge_shape"], axis=0),
        helper.make_node("Reshape", ["back", "merge_shape"], ["merged"]),
        helper.make_node("MatMul", ["merged", "w"], ["dense"]),
        helper.make_node("Add", ["dense", "x"], ["residual"]),
        helper.make_node("LayerNormalization", ["residual", "gamma", "beta"], ["y"], axis=-1),
    ]
    inits = [
        const("heads", np.array([2, d // 2], np.int64)),
        const("width", np.array([d], np.int64)),
        const("w", RNG.standard_normal((d, d)).astype(np.float32)),
        const("gamma", np.ones(d, np.float32)),
        const("beta", np.zeros(d, np.float32)),
    ]
    return make_model(nodes, [f32("x", ["B", "S", d])], [f32("y", ["B", "S", d])], inits)


def test_inferred_shapes_do_not_make_onnxruntime_fuse_skip_layernorm(tmp_path: Path) -> None:
    # onnxruntime fuses Add + LayerNormalization into SkipLayerNormalization when it knows both
    # Add inputs have the same 3-D shape; that CPU kernel is several times slower than the
    # two ops. Shapes Kiln's inference found (through the computed Reshape) must not leak.
    model = residual_layernorm_model()
    assert "SkipLayerNormalization" not in ort_optimized_op_types(model, tmp_path)
    out, _ = optimize_model(model)
    assert "SkipLayerNormalization" not in ort_optimized_op_types(out, tmp_path)
    assert list(out.graph.value_info) == []  # the source declares none
    assert_same_outputs(model, out, B=2, S=5)


def test_value_info_the_source_declares_is_kept() -> None:
    model = residual_layernorm_model()
    model.graph.value_info.append(f32("dense", ["B", "S", 8]))
    out, _ = optimize_model(model)
    assert [vi.name for vi in out.graph.value_info] == ["dense"]
    kept, _ = optimize_model(model, keep_inferred_shapes=True)
    assert len(kept.graph.value_info) > 5


# --- the speed guard ----------------------------------------------------------------------


def test_speed_guard_keeps_the_source_only_when_the_optimised_model_loses_every_round() -> None:
    source = [1.0e-3, 1.1e-3, 0.9e-3, 1.0e-3, 1.0e-3]
    slower = speed.decide(source, [t * 1.2 for t in source])
    assert slower.kept == "source" and slower.ratio == pytest.approx(1.2) and slower.rounds == 5
    assert "source model is kept" in slower.reason
    faster = speed.decide(source, [t * 0.8 for t in source])
    assert faster.kept == "optimised" and faster.ratio == pytest.approx(0.8)
    # Within the margin: noise, not a slowdown.
    assert speed.decide(source, [t * 1.03 for t in source]).kept == "optimised"
    # Slower by the median but faster in one round: not measurably slower.
    mixed = [t * r for t, r in zip(source, [1.3, 1.3, 1.3, 1.3, 0.95], strict=True)]
    verdict = speed.decide(source, mixed)
    assert verdict.kept == "optimised" and verdict.ratio_min == pytest.approx(0.95)
    body = slower.to_dict()
    assert body["engine"] == "onnxruntime" and body["source_ms"] == 1.0 and body["optimised_ms"] == 1.2
    with pytest.raises(ValueError):
        speed.decide([1.0], [1.0, 2.0])


def test_the_optimize_step_records_the_speed_guard(tmp_path: Path, transformer_onnx: Path) -> None:
    art = run_optimize_step(step_context(tmp_path, transformer_onnx))
    guard = art.meta["speed_guard"]
    assert guard["checked"] is True and guard["engine"] == "onnxruntime"
    assert guard["kept"] in ("optimised", "source") and guard["rounds"] == speed.ROUNDS
    assert guard["source_ms"] > 0 and guard["optimised_ms"] > 0
    assert guard["ratio_min"] <= guard["ratio"] <= guard["ratio_max"]
    kept_nodes = len(onnx.load(str(art.path)).graph.node)
    assert kept_nodes == (art.meta["nodes_after"] if guard["kept"] == "optimised" else art.meta["nodes_before"])


def test_the_optimize_step_keeps_the_source_when_it_runs_faster(
    tmp_path: Path, transformer_onnx: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Provoke the fault the guard exists for: the optimised model timed 1.5x slower.
    def timed_slower(source: Any, optimised: Any, feed: Any, **_: Any) -> tuple[list[float], list[float]]:
        return [1e-3] * speed.ROUNDS, [1.5e-3] * speed.ROUNDS

    monkeypatch.setattr(speed, "time_interleaved", timed_slower)
    art = run_optimize_step(step_context(tmp_path, transformer_onnx))
    guard = art.meta["speed_guard"]
    assert guard["kept"] == "source" and guard["ratio"] == 1.5
    source = onnx.load(str(transformer_onnx))
    kept = onnx.load(str(art.path))
    assert op_types(kept) == op_types(source)
    assert art.meta["nodes_after"] == art.meta["nodes_before"] == len(source.graph.node)
    assert_same_outputs(source, kept, batch=2)


def test_the_speed_guard_does_not_time_a_model_that_does_not_run() -> None:
    keep_source, guard = speed_guard(conv_bn_model(), conv_bn_model(), None)
    assert keep_source is False and guard["checked"] is False and "no inputs" in guard["reason"]


# --- TorchScript's expand: Where(Equal(shape, -1), 1, shape) ------------------------------------


def expand_select_model(*, tail: Any = -1, vector_from_input: bool = False) -> onnx.ModelProto:
    """``x.expand(batch, tail)`` as the TorchScript exporter writes it (Kiln's folding done by hand:
    the -1s are ``Mul(ConstantOfShape([2]), -1)`` and the vector is flattened to [-1])."""
    first = (
        [helper.make_node("Identity", ["dims"], ["batch"])]
        if vector_from_input
        else [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Gather", ["shape", "zero"], ["b0"], axis=0),
            helper.make_node("Unsqueeze", ["b0", "axes"], ["batch"]),
        ]
    )
    nodes = [
        *first,
        helper.make_node("Concat", ["batch", "tail"], ["sizes"], axis=0),
        helper.make_node("Reshape", ["sizes", "flat"], ["vector"]),
        helper.make_node("ConstantOfShape", ["two"], ["ones"], value=numpy_helper.from_array(np.array([1], np.int64))),
        helper.make_node("Mul", ["ones", "minus_one"], ["minus_ones"]),
        helper.make_node("Equal", ["vector", "minus_ones"], ["keep"]),
        helper.make_node("Where", ["keep", "ones", "vector"], ["target"]),
        helper.make_node("Expand", ["row", "target"], ["y"]),
    ]
    inits = [
        const("zero", np.array(0, np.int64)),
        const("axes", np.array([0], np.int64)),
        const("tail", np.array([tail], np.int64)),
        const("flat", np.array([-1], np.int64)),
        const("two", np.array([2], np.int64)),
        const("minus_one", np.array(-1, np.int64)),
        const("row", RNG.standard_normal((1, 6)).astype(np.float32)),
    ]
    inputs = [f32("x", ["N", 3])]
    if vector_from_input:
        inputs.append(helper.make_tensor_value_info("dims", TensorProto.INT64, [1]))
    return make_model(nodes, inputs, [f32("y", ["N", 6])], inits)


def test_expand_select_over_dimensions_folds_away() -> None:
    model = expand_select_model()
    out, _ = optimize_model(model)
    ops = op_types(out)
    # One Concat of the batch dimension and the constant (the select resolved to 6 there).
    assert "Where" not in ops and "Equal" not in ops and "ConstantOfShape" not in ops and "Reshape" not in ops
    assert ops.count("Expand") == 1 and ops.count("Concat") == 1
    assert_same_outputs(model, out, N=4)


def test_expand_select_stays_when_a_piece_may_be_negative() -> None:
    # The vector's first part is a graph input: it may hold -1, so the select must stay.
    model = expand_select_model(vector_from_input=True)
    out, _ = optimize_model(model)
    assert "Where" in op_types(out)
    feeds = {"x": np.ones((4, 3), np.float32), "dims": np.array([-1], np.int64)}
    np.testing.assert_array_equal(run(out, feeds)[0], run(model, feeds)[0])
    feeds["dims"] = np.array([5], np.int64)
    np.testing.assert_array_equal(run(out, feeds)[0], run(model, feeds)[0])


def test_small_constant_of_shape_folds_and_large_stays() -> None:
    def model_for(n: int) -> onnx.ModelProto:
        nodes = [
            helper.make_node(
                "ConstantOfShape", ["shape"], ["c"], value=numpy_helper.from_array(np.array([2.0], np.float32))
            ),
            helper.make_node("Add", ["x", "c"], ["y"]),
        ]
        return make_model(nodes, [f32("x", [n])], [f32("y", [n])], [const("shape", np.array([n], np.int64))])

    small, large = model_for(4), model_for(4096)
    assert op_types(optimize_model(small)[0]) == ["Add"]
    assert op_types(optimize_model(large)[0]) == ["ConstantOfShape", "Add"]
    assert_same_outputs(small, optimize_model(small)[0])
