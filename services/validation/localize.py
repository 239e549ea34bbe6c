"""Where an ONNX-family artifact starts to differ: the first node whose output drifts from the fp32 graph's.

What Polygraphy makes a user do by hand (mark every tensor as an output, run both sides,
compare layer by layer), done when parity fails: the fp32 ONNX graph the export started
from is run by onnxruntime with every intermediate tensor exposed (graph optimisations off,
so the names stay), the artifact likewise (onnxruntime for ONNX; OpenVINO for IR, whose
tensors keep the ONNX names unless a fusion folded them away), on the sample parity found
worst. Walking the fp32 graph's nodes in order, the first whose output (present on both
sides) falls below the tolerances' SNR or Pearson bound is named, with its metrics.

Accumulated rounding can cross a bound gradually, so on an artifact that is merely
imprecise the node named is where the error first became too large, not a single culprit;
on an artifact with one broken node it is that node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from services.formats import Format
from services.spec import Tolerances
from services.validation.metrics import measure_output

__all__ = ["describe", "localize_divergence"]

#: At most this many intermediate tensors are compared (a bound on memory for very deep graphs).
MAX_TENSORS = 4000


def _float_tensors(model: Any) -> list[tuple[str, str, str]]:
    """Return (tensor, node name, op type) of every node output of ``model``, in graph order."""
    out = []
    for i, node in enumerate(model.graph.node):
        if node.op_type in ("Constant", "Shape", "ConstantOfShape", "Size"):
            continue
        for name in node.output:
            if name:
                out.append((name, node.name or f"{node.op_type}_{i}", node.op_type))
    return out


def _quantized_views(model: Any) -> dict[str, str]:
    """Return tensor -> the DequantizeLinear output that stands for it, where it is quantised (QDQ).

    In a QDQ graph a tensor ``T`` is computed in float, then passes QuantizeLinear and
    DequantizeLinear before any consumer reads it; and onnxruntime's quantiser folds a Relu or
    Clip into that range, so ``T`` itself may be the unclipped value. What the graph computes
    for ``T`` is the DequantizeLinear output.
    """
    consumers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    views = {}
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or not node.output:
            continue
        dq = [c for c in consumers.get(node.output[0], ()) if c.op_type == "DequantizeLinear"]
        if dq and dq[0].output:
            views[node.input[0]] = dq[0].output[0]
    return views


def _run_onnx_exposed(path: Path, feed: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
    """Run the ONNX model at ``path`` with ``names`` (those it has) exposed; return the float ones by name."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(path))
    have = {o for n in model.graph.node for o in n.output}
    views = _quantized_views(model)
    existing = {o.name for o in model.graph.output}
    exposed = {}
    for name in names:
        if name not in have:
            continue
        real = views.get(name, name)
        exposed[real] = name
        if real not in existing:
            model.graph.output.append(onnx.ValueInfoProto(name=real))
            existing.add(real)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    wanted = [o.name for o in session.get_outputs()]
    feeds = {i.name: feed[i.name] for i in session.get_inputs() if i.name in feed}
    values = session.run(wanted, feeds)
    out = {}
    for n, v in zip(wanted, values, strict=True):
        if isinstance(v, np.ndarray) and v.dtype.kind == "f":
            out[exposed.get(n, n)] = v
    return out


def _run_ir_exposed(path: Path, feed: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
    """Run the OpenVINO IR at ``path`` with every tensor of ``names`` it still has exposed.

    Where NNCF put a FakeQuantize after a tensor, the FakeQuantize's output stands for it:
    that is the value the next layers read.
    """
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(path))
    wanted = set(names)
    views: list[Any] = []
    tags: dict[str, list[str]] = {}  # a tag we name each exposed port by -> the fp32 graph's tensor names
    for op in model.get_ops():
        for port in op.outputs():
            hits = sorted(wanted & set(port.get_names()))
            if not hits:
                continue
            view = port
            for target in port.get_target_inputs():
                node = target.get_node()
                if node.get_type_name() == "FakeQuantize":
                    view = node.output(0)
                    break
            tag = f"kiln.localize.{len(views)}"
            view.get_tensor().add_names({tag})
            views.append(view)
            tags[tag] = hits
    if views:
        model.add_outputs(views)
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    inputs = {}
    for port in compiled.inputs:
        for n in port.get_names():
            if n in feed:
                inputs[port] = feed[n]
                break
    request.infer(inputs)
    out: dict[str, np.ndarray] = {}
    for i, port in enumerate(compiled.outputs):
        arr = np.asarray(request.get_output_tensor(i).data).copy()
        if arr.dtype.kind != "f":
            continue
        for tag in set(port.get_names()) & set(tags):
            for name in tags[tag]:
                out[name] = arr
    return out


def localize_divergence(
    fp32_onnx: Path,
    artifact: Path,
    fmt: Format,
    feed: dict[str, np.ndarray],
    tol: Tolerances,
) -> dict[str, Any]:
    """Return the first node of ``fp32_onnx`` whose output the artifact gets wrong, on ``feed``.

    The result names the node, its op type and tensor, its SNR and Pearson against the fp32
    graph, and how many tensors were compared; ``node`` is None when every shared tensor stays
    within the bounds (the outputs alone differ, or the artifact kept no intermediate names).
    """
    import onnx

    graph = onnx.load(str(fp32_onnx), load_external_data=False)
    tensors = _float_tensors(graph)[:MAX_TENSORS]
    names = [t for t, _, _ in tensors]
    expected = _run_onnx_exposed(fp32_onnx, feed, names)
    if fmt is Format.ONNX:
        actual = _run_onnx_exposed(artifact, feed, names)
    elif fmt is Format.OPENVINO_IR:
        actual = _run_ir_exposed(artifact, feed, names)
    else:
        raise ValueError(f"no localisation for {fmt.value} artifacts")
    compared = 0
    for tensor, node, op in tensors:
        a, b = actual.get(tensor), expected.get(tensor)
        if a is None or b is None or a.size != b.size or b.size == 0:
            continue
        compared += 1
        m = measure_output([np.reshape(a, b.shape)], [b], atol=None, rtol=None, axis=None)
        bad_snr = tol.min_snr_db is not None and m.snr_db is not None and not (m.snr_db >= tol.min_snr_db)
        bad_r = tol.min_pearson is not None and m.pearson is not None and not (m.pearson >= tol.min_pearson)
        if bad_snr or bad_r or m.nonfinite:
            return {
                "node": node,
                "op_type": op,
                "tensor": tensor,
                "snr_db": m.snr_db,
                "pearson": m.pearson,
                "nonfinite": m.nonfinite,
                "compared": compared,
            }
    return {"node": None, "op_type": None, "tensor": None, "snr_db": None, "pearson": None, "compared": compared}


def describe(loc: dict[str, Any] | None) -> str | None:
    """Return e.g. ``first divergent node: /blocks.3/attn/Softmax (Softmax), SNR 3.1 dB``, or None."""
    if not loc or not loc.get("node"):
        return None
    metrics = []
    if loc.get("snr_db") is not None:
        metrics.append(f"SNR {loc['snr_db']:.1f} dB")
    if loc.get("pearson") is not None:
        metrics.append(f"Pearson {loc['pearson']:.4f}")
    if loc.get("nonfinite"):
        metrics.append(f"{loc['nonfinite']} non-finite values")
    return f"first divergent node: {loc['node']} ({loc['op_type']})" + (", " + ", ".join(metrics) if metrics else "")
