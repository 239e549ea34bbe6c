"""The tfserving target: a SavedModel laid out as ``<name>/<version>/saved_model.pb + variables/``.

fp32 is the incoming SavedModel as it is (from Keras natively, from ONNX via onnx2tf, or the
user's own). fp16 and int8 are what TF Serving can faithfully serve on a CPU: the signature
is frozen and every float32 weight constant is stored at the lower precision (float16, or
symmetric int8 with one scale per output channel) and turned back into float32 where the
graph reads it; inputs, outputs and arithmetic stay float32. TensorFlow's CPU kernels mostly
have no float16 or int8 variants, so a reduced-precision-compute graph would be slower and
less exact; what the lower precision buys here is a 2x (fp16) or 4x (int8) smaller model,
and parity measures exactly the rounding of the weights. int8 is weight-only, so it needs
no calibration data (a spec's calibration file only feeds the parity check).

The signature name and its input/output keys and tensor names go into the report and from
there into the provenance manifest; the publisher writes TF Serving's models.config.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from services.artifacts import DESCRIPTOR, Artifact
from services.exporters._common import finish_export
from services.formats import Format
from services.repository.layouts import OVMS_F32
from services.runners.tensorflow import DEFAULT_SIGNATURE
from services.spec import Precision
from services.steps.context import StepContext

__all__ = ["SERVING", "compress_weights", "export_tfserving", "write_compressed_savedmodel"]

SERVING = {"tfserving": True, "ovms": OVMS_F32}
#: Float constants smaller than this stay float32: they are epsilons, shapes and scalars, not weights.
MIN_WEIGHT_ELEMENTS = 16


def _copy_savedmodel(src: Path, dest: Path) -> None:
    for item in src.iterdir():
        if item.name == DESCRIPTOR:
            continue
        if item.is_dir():
            shutil.copytree(item, dest / item.name)
        else:
            shutil.copy2(item, dest / item.name)
    # TF Serving's loader wants variables/ even when a graph has none.
    (dest / "variables").mkdir(exist_ok=True)


def _cast_node(name: str, src: str, src_dtype: Any, device: str) -> Any:
    import tensorflow as tf

    node = tf.compat.v1.NodeDef(name=name, op="Cast", input=[src])
    node.attr["SrcT"].type = src_dtype.as_datatype_enum
    node.attr["DstT"].type = tf.float32.as_datatype_enum
    node.attr["Truncate"].b = False
    node.device = device
    return node


def _const_node(name: str, value: Any, device: str) -> Any:
    import tensorflow as tf

    node = tf.compat.v1.NodeDef(name=name, op="Const")
    node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
    node.device = device
    return node


def compress_weights(graph_def: Any, precision: Precision) -> dict[str, int]:
    """Store float32 weight constants at ``precision`` in place; return counts and bytes.

    fp16: the constant becomes float16 + Cast to float32. int8: symmetric int8 with one
    scale per output channel — the last axis of TensorFlow's HWIO conv and [in, out] dense
    kernels, the third of a depthwise [h, w, C, 1] kernel — then Cast and Mul by the scales.
    1-D constants (biases, BatchNorm vectors) stay float32 at int8: one scale per element
    would store more bytes than the floats. Either way every consumer still reads a
    float32 tensor under the constant's original name, so the graph is otherwise untouched.
    """
    import numpy as np
    import tensorflow as tf

    stats = {"constants_compressed": 0, "weight_bytes_fp32": 0, "weight_bytes_stored": 0}
    kept, added = [], []
    for node in graph_def.node:
        if node.op != "Const" or node.attr["dtype"].type != tf.float32.as_datatype_enum:
            kept.append(node)
            continue
        value = tf.make_ndarray(node.attr["value"].tensor)
        if value.size < MIN_WEIGHT_ELEMENTS:
            kept.append(node)
            continue
        name, device = node.name, node.device
        if precision is Precision.FP16:
            stored = value.astype(np.float16)
            added += [
                _const_node(f"{name}/kiln_fp16", stored, device),
                _cast_node(name, f"{name}/kiln_fp16", tf.float16, device),
            ]
        else:
            if value.ndim < 2:
                kept.append(node)
                continue
            channel = value.ndim - 1 if value.shape[-1] > 1 else value.ndim - 2
            axes = tuple(i for i in range(value.ndim) if i != channel)
            peak = np.abs(value).max(axis=axes, keepdims=True)
            scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
            stored = np.clip(np.round(value / scale), -127, 127).astype(np.int8)
            mul = tf.compat.v1.NodeDef(
                name=name, op="Mul", input=[f"{name}/kiln_int8_float", f"{name}/kiln_int8_scale"]
            )
            mul.attr["T"].type = tf.float32.as_datatype_enum
            mul.device = device
            added += [
                _const_node(f"{name}/kiln_int8", stored, device),
                _cast_node(f"{name}/kiln_int8_float", f"{name}/kiln_int8", tf.int8, device),
                _const_node(f"{name}/kiln_int8_scale", scale, device),
                mul,
            ]
            stats["weight_bytes_stored"] += scale.size * 4
        stats["constants_compressed"] += 1
        stats["weight_bytes_fp32"] += value.size * 4
        stats["weight_bytes_stored"] += stored.nbytes
    del graph_def.node[:]
    graph_def.node.extend(kept + added)
    return stats


def _tensor_info(tensor: Any) -> Any:
    # The TensorInfo proto written directly: tf.compat.v1's build_tensor_info logs a deprecation per call.
    from tensorflow.core.protobuf import meta_graph_pb2

    return meta_graph_pb2.TensorInfo(
        name=tensor.name, dtype=tensor.dtype.as_datatype_enum, tensor_shape=tensor.shape.as_proto()
    )


_STORAGE = {
    Precision.FP16: "float16, cast to float32 where the graph reads them",
    Precision.INT8: "int8 symmetric, one scale per output channel, dequantized to float32 in the graph; 1-D constants kept float32",
}


def write_compressed_savedmodel(
    src: Path, dest: Path, precision: Precision, signature: str = DEFAULT_SIGNATURE
) -> dict[str, Any]:
    """Write a frozen SavedModel of ``signature`` with weights stored at ``precision``; return what changed."""
    import tensorflow as tf
    from tensorflow.core.protobuf import meta_graph_pb2

    from services.converters.tf_freezing import freeze_function
    from services.runners.tensorflow import load_signature

    _loaded, fn = load_signature(src, signature)
    frozen = freeze_function(fn)
    graph_def = frozen.graph_def
    stats = compress_weights(graph_def, precision)
    # The frozen function's placeholders and results follow the flattened (key-sorted) signature.
    _, kwargs = fn.structured_input_signature
    in_keys = tf.nest.flatten({k: k for k in kwargs})
    out_keys = tf.nest.flatten({k: k for k in fn.structured_outputs})
    in_names, out_names = frozen.inputs, frozen.outputs
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
        sig_def = meta_graph_pb2.SignatureDef(
            inputs={k: _tensor_info(graph.get_tensor_by_name(n)) for k, n in zip(in_keys, in_names, strict=True)},
            outputs={k: _tensor_info(graph.get_tensor_by_name(n)) for k, n in zip(out_keys, out_names, strict=True)},
            method_name=tf.saved_model.PREDICT_METHOD_NAME,
        )
        with tf.compat.v1.Session(graph=graph) as sess:
            builder = tf.compat.v1.saved_model.Builder(str(dest))
            builder.add_meta_graph_and_variables(
                sess, [tf.saved_model.SERVING], signature_def_map={signature: sig_def}, strip_default_attrs=True
            )
            builder.save()
    (dest / "variables").mkdir(exist_ok=True)
    return {"weights": _STORAGE[precision], "compute": "float32", "frozen": True, **stats}


def export_tfserving(ctx: StepContext) -> Artifact:
    """Write the SavedModel at the job's precision, validated and benchmarked with TensorFlow."""
    from services.converters.tensorflow_native import signature_tensors

    precision = Precision(ctx.step.options.get("precision", ctx.spec.precision.value))
    from_source = ctx.step.inputs.get("model") == "source"
    signature = ctx.spec.signature if from_source else DEFAULT_SIGNATURE
    src = ctx.model.path
    out = ctx.out_dir
    details: dict[str, Any] = {}
    if precision is Precision.FP32:
        _copy_savedmodel(src, out)
    else:
        ctx.progress(f"freezing the signature and storing weights as {precision.value}")
        staged = out / "_staged"  # the Builder insists on creating its directory itself
        details[precision.value] = write_compressed_savedmodel(src, staged, precision, signature)
        for item in staged.iterdir():
            item.rename(out / item.name)
        staged.rmdir()
    details["signature"] = signature_tensors(out, signature)
    details["size_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != DESCRIPTOR)
    return finish_export(
        ctx,
        fmt=Format.SAVEDMODEL,
        entry="",
        precision=precision,
        serving=SERVING,
        runner_options={"signature": signature},
        engine_details={"tfserving": details},
    )
