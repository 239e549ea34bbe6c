"""The verifier's adversaries: models built to fool a parity check, and an exporter that breaks its artifact.

The saboteur stands in for a converter bug: it is the real onnxruntime export (fp32, fp16 via
onnxruntime's float16 converter, int8 via static QDQ quantisation) of a graph it broke on
purpose first, then the real parity check against the untouched source. Which break comes
from the job's name (``sabotage-<kind>``), so a plan made anywhere (``kiln compile``,
``POST /compile``) carries it to the step. A mock may provoke a fault; what is shown working
here is the real verifier catching it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Breaks the saboteur knows, by the job name's suffix.
SABOTAGES = ("scale", "bias", "constant", "zero-one-sample", "ignore-mask", "break-node")
#: The first element of the one sample "zero-one-sample" zeroes (see mark_one_sample).
MARK = 7.25


# ----------------------------------------------------------------------------- models


def _save(graph: Any, path: Path, opset: int = 17) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def conv_net(path: Path, seed: int = 0) -> Path:
    """x [N,3,16,16] -> Conv -> Relu -> Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> y [N,10]."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((8, 3, 3, 3)) * 0.4).astype(np.float32)
    w2 = (rng.standard_normal((8, 8, 3, 3)) * 0.2).astype(np.float32)
    fc = (rng.standard_normal((8, 10)) * 0.5).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "fc"], ["y"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (w2, "w2"), (fc, "fc"))],
    )
    return _save(graph, path)


def large_logits(path: Path, seed: int = 0) -> Path:
    """x [N,3,16,16] -> conv net whose logits reach ~1e3: a per-pixel map y [N,4,16,16] and class scores z [N,10].

    The magnitudes of MediaPipe's segmentation logits (~1700) and of an embedding of +-46: one
    unit of an absolute atol is far below what float rounding leaves at that size (fp16 spaces
    values near 1000 0.5 apart), while the values cross zero everywhere.
    """
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((8, 3, 3, 3)) * 0.4).astype(np.float32)
    w2 = (rng.standard_normal((4, 8, 3, 3)) * 60.0).astype(np.float32)
    fc = (rng.standard_normal((8, 10)) * 400.0).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["y"], name="seg", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["r1"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "fc"], ["z"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "large_logits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 16, 16]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 10]),
        ],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (w2, "w2"), (fc, "fc"))],
    )
    return _save(graph, path)


def masked_mean(path: Path, seed: int = 0) -> Path:
    """x [N,T] float, mask [N,T] int64 -> y [N,4]: a projection of the mask-weighted mean of x over T."""
    w = (np.random.default_rng(seed).standard_normal((1, 4)) * 2).astype(np.float32)
    nodes = [
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "m"], ["xm"]),
        helper.make_node("ReduceSum", ["xm", "axes"], ["s"], keepdims=1),
        helper.make_node("ReduceSum", ["m", "axes"], ["n"], keepdims=1),
        helper.make_node("Div", ["s", "n"], ["mean"]),
        helper.make_node("MatMul", ["mean", "w"], ["y"], name="project"),
    ]
    graph = helper.make_graph(
        nodes,
        "masked_mean",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["N", "T"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(np.array([1], np.int64), "axes"), numpy_helper.from_array(w, "w")],
    )
    return _save(graph, path)


def activation_outliers(path: Path, seed: int = 0) -> Path:
    """The classic int8 failure of transformers, built on purpose: informative channels beside huge ones.

    h = x @ W1 + b1 has 14 channels of about +-0.05 carrying the signal and 2 of about +-200
    carrying none; y = h @ W2 + b2 reads the small ones, with an output bias of 50. A per-tensor
    int8 scale for h is set by the +-200 channels (step ~1.6), so every informative channel
    rounds to zero: y becomes the bias plus noise, while its uncentred cosine with the source
    stays ~0.999 (the bias dominates both).
    """
    rng = np.random.default_rng(seed)
    w1 = np.zeros((16, 16), np.float32)
    w1[:14, :14] = rng.standard_normal((14, 14)) * 0.02
    w1[14:, 14:] = np.eye(2) * 200.0
    w2 = np.zeros((16, 8), np.float32)
    w2[:14] = rng.standard_normal((14, 8)) * 20.0
    b2 = np.full((8,), 50.0, np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="expand"),
        helper.make_node("MatMul", ["h", "w2"], ["hw"], name="read"),
        helper.make_node("Add", ["hw", "b2"], ["y"], name="bias"),
    ]
    graph = helper.make_graph(
        nodes,
        "outliers",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(b2, "b2")],
    )
    return _save(graph, path)


def all_nan(path: Path) -> Path:
    """y = Log(-|x| - 1): NaN for every input."""
    nodes = [
        helper.make_node("Abs", ["x"], ["a"]),
        helper.make_node("Neg", ["a"], ["n"]),
        helper.make_node("Sub", ["n", "one"], ["m"]),
        helper.make_node("Log", ["m"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "all_nan",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(np.array(1.0, np.float32), "one")],
    )
    return _save(graph, path)


def mark_one_sample(calibration: dict[str, np.ndarray], name: str = "x", row: int = 43) -> None:
    """Set the first element of ``row`` to MARK: the sample "zero-one-sample" breaks.

    Row 43 is held out for parity (every fourth row is) and is the 11th parity sample, past
    the few that the second shape's samples stack.
    """
    calibration[name].reshape(calibration[name].shape[0], -1)[row, 0] = MARK


# ----------------------------------------------------------------------------- breaks


def _reroute_outputs(model: Any) -> list[tuple[str, str]]:
    """Rename each graph output's producer to ``<name>_orig``; return (original, new) pairs to rewire."""
    pairs = []
    for out in model.graph.output:
        orig = f"{out.name}_orig"
        for node in model.graph.node:
            node.output[:] = [orig if o == out.name else o for o in node.output]
            node.input[:] = [orig if i == out.name else i for i in node.input]
        pairs.append((out.name, orig))
    return pairs


def sabotage(model: Any, kind: str, output_std: dict[str, float]) -> Any:
    """Return ``model`` broken in the way ``kind`` names (see SABOTAGES)."""
    g = model.graph
    if kind == "break-node":
        # One interior node computes something else: conv2 reads its weights x3.
        w2 = next(i for i in g.initializer if i.name == "w2")
        w2.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w2) * 3.0, "w2"))
        return model
    if kind == "ignore-mask":
        # The graph forgets the mask: every position counts, as with an all-ones mask.
        for node in g.node:
            node.input[:] = ["x_like_mask" if i == "attention_mask" else i for i in node.input]
        g.node.insert(0, helper.make_node("Shape", ["x"], ["x_shape"]))
        g.node.insert(
            1,
            helper.make_node(
                "ConstantOfShape",
                ["x_shape"],
                ["x_like_mask"],
                value=helper.make_tensor("one", TensorProto.INT64, [1], [1]),
            ),
        )
        return model
    for name, orig in _reroute_outputs(model):
        if kind == "scale":
            g.initializer.append(numpy_helper.from_array(np.array(2.0, np.float32), f"{name}_two"))
            g.node.append(helper.make_node("Mul", [orig, f"{name}_two"], [name]))
        elif kind == "bias":
            bias = np.array(output_std[name], np.float32)
            g.initializer.append(numpy_helper.from_array(bias, f"{name}_bias"))
            g.node.append(helper.make_node("Add", [orig, f"{name}_bias"], [name]))
        elif kind == "constant":
            g.node.append(helper.make_node("ReduceMean", [orig], [f"{name}_mean"], keepdims=1))
            g.node.append(helper.make_node("Shape", [orig], [f"{name}_shape"]))
            g.node.append(helper.make_node("Expand", [f"{name}_mean", f"{name}_shape"], [name]))
        elif kind == "zero-one-sample":
            # Rows whose first input element is MARK give zeros: one sample among many.
            g.initializer.extend(
                [
                    numpy_helper.from_array(np.array([0, -1], np.int64), "flat_shape"),
                    numpy_helper.from_array(np.array([0], np.int64), "first"),
                    numpy_helper.from_array(np.array([MARK], np.float32), "mark"),
                    numpy_helper.from_array(np.array([-1, 1], np.int64), "col_shape"),
                    numpy_helper.from_array(np.array([0.5], np.float32), "half"),
                ]
            )
            g.node.extend(
                [
                    helper.make_node("Reshape", ["x", "flat_shape"], ["x_flat"]),
                    helper.make_node("Gather", ["x_flat", "first"], ["x_first"], axis=1),
                    # Within 0.5, not equal: an int8 graph reads the input through its quantisation.
                    helper.make_node("Sub", ["x_first", "mark"], ["off"]),
                    helper.make_node("Abs", ["off"], ["dist"]),
                    helper.make_node("Less", ["dist", "half"], ["is_mark"]),
                    helper.make_node("Not", ["is_mark"], ["keep_b"]),
                    helper.make_node("Cast", ["keep_b"], ["keep"], to=TensorProto.FLOAT),
                    helper.make_node("Reshape", ["keep", "col_shape"], ["keep_col"]),
                    helper.make_node("Mul", [orig, "keep_col"], [name]),
                ]
            )
        else:
            raise ValueError(f"unknown sabotage {kind!r}; known: {SABOTAGES}")
    return model


def sabotaged_export_onnxruntime(ctx: Any) -> Any:
    """The onnxruntime export of a graph broken as ``ctx.spec.name`` says, checked against the real source."""
    from services.exporters._common import calibration_feeds, finish_export
    from services.exporters.onnxruntime import MODEL_FILE, SERVING, quantize_int8, to_fp16
    from services.formats import Format
    from services.spec import Precision
    from services.steps.reference import load_reference

    kind = (ctx.spec.name or "").removeprefix("sabotage-")
    precision = Precision(ctx.step.options.get("precision", ctx.spec.precision.value))
    ref = load_reference(ctx.reference)
    std = {n: float(np.concatenate([np.ravel(o[n]) for o in ref.outputs]).std()) for n in ref.output_names}
    # A break inside the graph goes in before the conversion (the converter keeps it); a break of
    # the outputs goes in after it, where the quantiser cannot calibrate it away.
    inside = kind in ("ignore-mask", "break-node")
    src = ctx.model.path
    ctx.scratch.mkdir(parents=True, exist_ok=True)
    if inside:
        src = ctx.scratch / "sabotaged.onnx"
        onnx.save(sabotage(onnx.load(str(ctx.model.path)), kind, std), str(src))
    dst = ctx.out_dir / MODEL_FILE
    if precision is Precision.FP32:
        onnx.save(onnx.load(str(src)), str(dst))
    elif precision is Precision.FP16:
        to_fp16(src, dst)
    else:
        feeds, _ = calibration_feeds(ref)
        (ctx.scratch / "int8").mkdir(parents=True, exist_ok=True)
        quantize_int8(src, dst, feeds, ctx.scratch / "int8")
    if not inside:
        onnx.save(sabotage(onnx.load(str(dst)), kind, std), str(dst))
    return finish_export(ctx, fmt=Format.ONNX, entry=MODEL_FILE, precision=precision, serving=SERVING)


def saboteur_registry() -> Any:
    """Kiln's converter graph with the onnxruntime exporter replaced by the saboteur."""
    from services.graph.registry import Registry, default_registry
    from services.spec import TargetName

    reg = Registry()
    for conv in default_registry().converters:
        reg.add_converter(conv)
    for exp in default_registry().exporters:
        if exp.target is TargetName.ONNXRUNTIME:
            exp = dataclasses.replace(exp, entry="verifier_support:sabotaged_export_onnxruntime")
        reg.add_exporter(exp)
    return reg
