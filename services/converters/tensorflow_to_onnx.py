"""Edges into ONNX from the TensorFlow family: Keras, TF SavedModel and TFLite, via tf2onnx.

Keras models and SavedModel signatures are wrapped in one ``tf.function`` whose inputs
carry the model's own input names and whose outputs are a dict keyed by its output names;
tf2onnx names the ONNX graph's inputs and outputs after them, so the reference (computed by
the source framework) and every later artifact agree on names. TFLite tensors carry
internal names (``serving_default_image:0``), so after conversion the graph's inputs and
outputs are renamed to the TFLite signature's names.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.artifacts import Artifact
from services.errors import ConversionFailed, tool_said
from services.formats import Format
from services.steps.context import StepContext

__all__ = [
    "DEFAULT_OPSET",
    "check_onnx_output",
    "keras_to_onnx",
    "rename_graph_io",
    "savedmodel_to_onnx",
    "tflite_to_onnx",
]

#: ONNX opset when the spec sets none: new enough for tf2onnx's full op coverage, and read by
#: every ONNX consumer Kiln targets (onnxruntime, OpenVINO, TensorRT, onnx2tf).
DEFAULT_OPSET = 17
MODEL_FILE = "model.onnx"
TOOL = "tf2onnx"


def _failed(ctx: StepContext, what: str, exc: Exception) -> ConversionFailed:
    text = str(exc).strip()
    return ConversionFailed(
        f"{TOOL} could not convert {what}: {tool_said(text, exc)}",
        hint="tf2onnx names the TensorFlow op it cannot express in ONNX; a higher `opset` in the spec may help.",
        step=ctx.step.id,
        tool=TOOL,
        output_tail=text[-2000:],
    )


def _value_spec(vi: Any) -> dict[str, Any]:
    import onnx

    tt = vi.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name if tt.elem_type else "unknown"
    shape = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
    return {"name": vi.name, "dtype": dtype, "shape": shape}


def _describe(model: Any) -> dict[str, Any]:
    inits = {i.name for i in model.graph.initializer}
    return {
        "inputs": [_value_spec(v) for v in model.graph.input if v.name not in inits],
        "outputs": [_value_spec(v) for v in model.graph.output],
        "nodes": len(model.graph.node),
    }


#: Call-node attributes that keep grappler from inlining a function into the graph. Keras 3
#: runs grouped convolutions (and some attention) as ``tf.function(jit_compile=True)``,
#: whose call carries ``_XlaMustCompile``; tf2onnx then left a ``StatefulPartitionedCall``
#: node in the ONNX graph that no runtime can load. For an ONNX graph XLA means nothing.
_NO_INLINE_ATTRS = ("_XlaMustCompile", "_XlaCompile", "_noinline")


def _inlinable(graph_def: Any) -> int:
    """Strip the attributes that block inlining from every node and function; return how many went."""
    removed = 0
    nodes = [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]
    for holder in [*nodes, *graph_def.library.function]:
        for attr in _NO_INLINE_ATTRS:
            if attr in holder.attr:
                del holder.attr[attr]
                removed += 1
    return removed


def _lower_erfc(model: Any) -> int:
    """Rewrite every ``Erfc`` node as ``1 - Erf(x)``; return how many there were.

    tf2onnx has no handler for TensorFlow's Erfc (what Keras' exact GELU computes, as in
    ConvNeXt) and passes it through as an ``Erfc`` node, which is no ONNX operator.
    """
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    found = [n for n in graph.node if n.op_type == "Erfc" and n.domain in ("", "ai.onnx")]
    if not found:
        return 0
    dtypes = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    nodes = []
    for node in graph.node:
        if node not in found:
            nodes.append(node)
            continue
        out = node.output[0]
        dtype = helper.tensor_dtype_to_np_dtype(dtypes.get(out) or dtypes.get(node.input[0]) or 1)
        one = numpy_helper.from_array(np.array(1, dtype=dtype), f"{node.name}/one")
        graph.initializer.append(one)
        nodes.append(helper.make_node("Erf", [node.input[0]], [f"{out}/erf"], name=f"{node.name}/erf"))
        nodes.append(helper.make_node("Sub", [one.name, f"{out}/erf"], [out], name=f"{node.name}/one_minus"))
    del graph.node[:]
    graph.node.extend(nodes)
    return len(found)


def _left_calls(model: Any) -> list[str]:
    """Return the op types of TensorFlow function-call nodes tf2onnx left in the ONNX graph."""
    return sorted({n.op_type for n in model.graph.node if n.op_type.endswith("PartitionedCall")})


def check_onnx_output(ctx: StepContext, model: Any, path: Path, what: str) -> None:
    """Raise CONVERSION_FAILED naming tf2onnx when the ONNX it wrote is not a model onnxruntime loads.

    A broken intermediate is the tool's fault, not the user's file: reported any later (by
    the optimiser or an exporter opening it) it read as SOURCE_UNREADABLE, "truncated".
    """
    import onnx
    import onnxruntime as ort

    calls = _left_calls(model)
    problem = f"it left TensorFlow function calls ({', '.join(calls)}) in the graph" if calls else ""
    if not problem:
        try:
            onnx.checker.check_model(str(path))
            ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnx.checker.ValidationError, onnxruntime's Fail/InvalidGraph...
            problem = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    if problem:
        raise ConversionFailed(
            f"{TOOL} wrote an invalid ONNX model for {what}: {problem}",
            hint="The source model is fine; tf2onnx could not express it. Another route (e.g. through a SavedModel) may.",
            step=ctx.step.id,
            tool=TOOL,
            output_tail=problem,
        )


def _collected_optimizers() -> dict[str, Any]:
    """tf2onnx's ONNX optimizers, each preceded by a full garbage collection.

    tf2onnx runs every optimizer on a ``copy.deepcopy`` of the graph (so that a failing one
    can be skipped) and drops the old copy; graphs are reference cycles (nodes point at their
    graph), so each dropped copy, weights included, waits for a full collection, which
    Python's heuristics seldom run. Measured on Keras ResNet-50 (98 MiB of weights): 6.1 GiB
    of garbage piled up and the optimizers took 16.4 s; collecting before each one holds the
    step at the size of two copies: 6.5 s, and 2.5 s with the ``gc.freeze`` _from_function
    adds around them (docs/benchmarks.md).
    """
    import gc

    from tf2onnx import optimizer

    def collected(factory: Any) -> Any:
        def make() -> Any:
            gc.collect()
            return factory()

        return make

    return {name: collected(factory) for name, factory in optimizer._get_optimizers().items()}


def _frozen_for_tf2onnx(concrete: Any, inputs: list[str], outputs: list[str]) -> tuple[Any, int]:
    """Freeze ``concrete`` as tf2onnx's ``tf_loader.from_function`` does; return the GraphDef and the unblocked calls.

    Same steps (freeze with aggressive inlining, tf2onnx's freezing fixes, grappler) with
    three differences: the freezing skips rebuilding a function
    (services/converters/tf_freezing.py), the attributes that block inlining go before
    grappler runs, so one grappler pass inlines every call, and no session import (below).
    """
    import tensorflow as tf
    from tf2onnx import tf_loader

    from services.converters.tf_freezing import freeze_function

    try:
        graph_def = freeze_function(concrete, lower_control_flow=False, aggressive_inlining=True).graph_def
    except ValueError as exc:  # tf2onnx's own way around resource-typed variables TensorFlow cannot freeze
        if "incompatible with expected resource" not in str(exc):
            raise
        graph_def = tf_loader.fix_freezing_errors(tf_loader.convert_variables_to_constants_large_model(concrete))
    graph_def = tf_loader.fix_freezing_errors_part2(graph_def)
    unblocked = _inlinable(graph_def)
    # tf2onnx imports the graph into a session first, for shapes on every node and to drop
    # resource inputs; the inputs here are the signature's tensors, never resources, and
    # grappler infers the shapes itself (measured on ResNet-50: same ONNX ops, weights and
    # outputs, 0.8 s less).
    with tf.Graph().as_default():  # grappler's meta-graph export needs graph mode
        return tf_loader.tf_optimize(inputs, outputs, graph_def), unblocked


def _from_function(ctx: StepContext, trace: Callable[[], Any], n_inputs: int, what: str) -> Artifact:
    """Trace the serving function (``trace()``), freeze it and convert it with tf2onnx; return model.onnx.

    The traced function's first ``n_inputs`` inputs are the signature's; the rest are captures.

    Kiln freezes the function itself instead of calling ``tf2onnx.convert.from_function``:
    that one takes every input of the concrete function as a graph input, captured constants
    included (a Keras ``Normalization(mean=..., variance=...)`` layer's two became extra
    ONNX inputs), and it cannot inline XLA-compiled calls (see ``_NO_INLINE_ATTRS``).
    """
    import gc

    import tensorflow as tf
    import tf2onnx

    opset = ctx.opset(DEFAULT_OPSET)
    ctx.progress(f"converting {what} to ONNX opset {opset} with tf2onnx")
    out = ctx.out_dir / MODEL_FILE
    try:
        concrete = trace()
        # The signature's tensors come first; the rest are captures, frozen into constants.
        inputs = [t.name for t in concrete.inputs[:n_inputs]]
        outputs = [t.name for t in concrete.outputs if t.dtype != tf.resource]
        renames = tf2onnx.convert.tensor_names_from_structed(concrete, inputs, outputs)
        with tf.device("/cpu:0"):
            frozen, unblocked = _frozen_for_tf2onnx(concrete, inputs, outputs)
        # Collected before each ONNX optimizer: see _collected_optimizers. Whatever exists
        # now (TensorFlow, Keras, the model) is frozen out of those collections, so each
        # scans only tf2onnx's own objects (measured 0.19 s a collection without this).
        gc.collect()
        gc.freeze()
        try:
            # What tf2onnx.convert.from_function does after freezing, with Kiln's optimizer list.
            model, _ = tf2onnx.convert._convert_common(
                frozen,
                name=concrete.name,
                continue_on_error=True,
                opset=opset,
                input_names=inputs,
                output_names=outputs,
                tensors_to_rename=renames,
                output_path=str(out),
                optimizers=_collected_optimizers(),
            )
        finally:
            gc.unfreeze()
        del frozen
    except Exception as exc:  # tf2onnx raises ValueError, KeyError, RuntimeError... for unsupported graphs
        raise _failed(ctx, what, exc) from exc
    lowered = _lower_erfc(model)
    if lowered:
        from services.onnx_io import save_onnx

        save_onnx(model, out)
    check_onnx_output(ctx, model, out, what)
    meta: dict[str, Any] = {"opset": opset, "tool": TOOL, **_describe(model)}
    if unblocked:
        meta["inlined_xla_calls"] = unblocked
    if lowered:
        meta["erfc_lowered"] = lowered
    return Artifact(root=ctx.out_dir, kind=Format.ONNX.value, entry=MODEL_FILE, meta=meta)


def keras_to_onnx(ctx: StepContext) -> Artifact:
    """Convert a Keras model (loaded in safe mode, never running stored code) to model.onnx."""
    from services.runners.tensorflow import keras_serving_concrete, load_keras_model

    model = load_keras_model(ctx.model.path)  # unsafe or unreadable files fail here, with their own codes

    def trace() -> Any:  # the job's one trace when the same process ran other steps of it
        return keras_serving_concrete(ctx.model.path)[1]

    return _from_function(ctx, trace, len(model.inputs), f"Keras model {ctx.model.path.name}")


def savedmodel_to_onnx(ctx: StepContext) -> Artifact:
    """Convert the spec's signature (default serving_default) of a SavedModel to model.onnx."""
    import tensorflow as tf

    from services.runners.tensorflow import DEFAULT_SIGNATURE, load_signature, signature_io

    name = ctx.step.options.get("signature") or ctx.spec.signature or DEFAULT_SIGNATURE
    _loaded, sig = load_signature(ctx.model.path, name)
    inputs, _ = signature_io(sig)
    names = [t.name for t in inputs]
    signature = [tf.TensorSpec(t.shape, tf.as_dtype(t.dtype), name=t.name) for t in inputs]

    def serve(*args: Any) -> dict[str, Any]:
        return dict(sig(**dict(zip(names, args, strict=True))))

    def trace() -> Any:
        return tf.function(serve, input_signature=signature).get_concrete_function()

    art = _from_function(ctx, trace, len(signature), f"SavedModel signature {name!r}")
    art.meta["signature"] = name
    return art


def rename_graph_io(model: Any, renames: dict[str, str]) -> None:
    """Rename graph inputs/outputs (and every reference to them) in place."""
    if not renames:
        return
    graph = model.graph
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        if vi.name in renames:
            vi.name = renames[vi.name]
    for init in graph.initializer:
        if init.name in renames:
            init.name = renames[init.name]
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
        for i, name in enumerate(node.output):
            if name in renames:
                node.output[i] = renames[name]


def _tflite_signature_names(path: Path, signature: str | None) -> dict[str, str]:
    """Return tensor name -> public name for a .tflite file (the names its runner reports)."""
    from services.runners.tflite import TFLiteRunner

    runner = TFLiteRunner(path, signature=signature)
    try:
        return runner.tensor_names()
    finally:
        runner.close()


def tflite_to_onnx(ctx: StepContext) -> Artifact:
    """Convert a .tflite model to model.onnx, named after its signature's inputs and outputs."""
    import tf2onnx

    from services.onnx_io import save_onnx

    opset = ctx.opset(DEFAULT_OPSET)
    src = ctx.model.path
    ctx.progress(f"converting TFLite {src.name} to ONNX opset {opset} with tf2onnx")
    try:
        with warnings.catch_warnings():
            # tf2onnx runs the model once with tf.lite.Interpreter, which warns about its own deprecation.
            warnings.filterwarnings("ignore", message=".*tf.lite.Interpreter is deprecated.*")
            model, _ = tf2onnx.convert.from_tflite(str(src), opset=opset)
    except Exception as exc:
        raise _failed(ctx, f"TFLite model {src.name}", exc) from exc
    # tf2onnx names graph I/O after the TFLite tensors; the signature's names are the public ones.
    by_tensor = _tflite_signature_names(src, ctx.step.options.get("signature") or ctx.spec.signature)
    io_names = [v.name for v in [*model.graph.input, *model.graph.output]]
    renames = {}
    for name in io_names:
        public = by_tensor.get(name) or by_tensor.get(name.removesuffix(":0"))
        if public and public != name:
            renames[name] = public
    rename_graph_io(model, renames)
    save_onnx(model, ctx.out_dir / MODEL_FILE)
    check_onnx_output(ctx, model, ctx.out_dir / MODEL_FILE, f"TFLite model {src.name}")
    return Artifact(
        root=ctx.out_dir,
        kind=Format.ONNX.value,
        entry=MODEL_FILE,
        meta={"opset": opset, "tool": TOOL, "renamed": renames, **_describe(model)},
    )
