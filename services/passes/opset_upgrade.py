"""Upgrade a graph of an opset older than the engines implement, with ONNX's own version converter.

Older exporters and the classic ONNX Model Zoo wrote opset 6 and below; onnxruntime no longer
implements operators such as ``AveragePool(1)`` or ``Add(6)`` (measured on ONNX's backend test
data: 34 of 140 models), and the optimiser's safety net, the onnxruntime exporter and pnnx all
run onnxruntime. ``onnx.version_converter`` rewrites such a graph op by op to a newer opset
(``AveragePool(1)`` to ``AveragePool(7)``, ...). The upgraded graph is then what every ONNX
target is built from, and every artifact is still compared with the reference, which the
original graph gave (in OpenVINO or ONNX's reference evaluator when onnxruntime cannot run it:
services/runners/onnx_source.py), so a conversion that changed the numbers fails parity.
"""

from __future__ import annotations

import re
from typing import Any

from services.errors import UnsupportedOps

__all__ = ["MIN_ONNX_OPSET", "upgrade_opset"]

#: The oldest default-domain opset every ONNX-consuming engine here implements: onnxruntime's
#: (and so the optimiser's safety net's and pnnx's); OpenVINO reads older ones too.
MIN_ONNX_OPSET = 7


def _opset(model: Any) -> int | None:
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=None)


#: Binary ops that took ``broadcast``/``axis`` attributes before opset 7.
_LEGACY_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal", "Greater", "Less"})


def _ranks(model: Any) -> dict[str, int]:
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        return {}
    ranks = {
        vi.name: len(vi.type.tensor_type.shape.dim)
        for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")
    }
    ranks.update({t.name: len(t.dims) for t in model.graph.initializer})
    return ranks


def _explicit_broadcasts(model: Any) -> list[str]:
    """Give a legacy ``broadcast=1, axis=k`` operand the trailing unit axes that put it at axis k; return the nodes.

    Before opset 7, ``Add(A[1,3,4,4], B[3], broadcast=1, axis=1)`` aligned B with A's axis 1;
    from opset 7 broadcasting aligns from the last axis. ONNX's converter drops the axis
    (measured: the upgraded graph gave [3,3,4,4] for [1,3,4,4]), so the operand is reshaped
    (a weight) or unsqueezed (a computed tensor) first; the attribute then means nothing more.
    """
    from onnx import helper, numpy_helper

    ranks = _ranks(model)
    weights = {t.name: t for t in model.graph.initializer}
    changed = []
    new_nodes: list[Any] = []
    for node in model.graph.node:
        attrs = {a.name: a for a in node.attribute}
        if node.op_type in _LEGACY_BROADCAST and "axis" in attrs and attrs.get("broadcast") and len(node.input) == 2:
            a_rank, b_rank = ranks.get(node.input[0]), ranks.get(node.input[1])
            axis = attrs["axis"].i
            if a_rank is not None and b_rank is not None:
                axis = axis + a_rank if axis < 0 else axis
                trailing = a_rank - axis - b_rank
                if trailing > 0:
                    b = node.input[1]
                    if b in weights:
                        arr = numpy_helper.to_array(weights[b])
                        weights[b].CopyFrom(numpy_helper.from_array(arr.reshape(*arr.shape, *([1] * trailing)), b))
                        for inp in model.graph.input:  # IR 3 lists every weight as an input too
                            if inp.name == b and inp.type.HasField("tensor_type"):
                                for _ in range(trailing):
                                    inp.type.tensor_type.shape.dim.add().dim_value = 1
                    else:
                        out = f"{b}__kiln_at_axis_{axis}_{len(new_nodes)}"
                        new_nodes.append(
                            helper.make_node("Unsqueeze", [b], [out], axes=list(range(b_rank, b_rank + trailing)))
                        )
                        node.input[1] = out
                    changed.append(node.name or node.output[0])
                node.attribute.remove(attrs["axis"])
        new_nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return changed


def _channel_slopes(model: Any) -> list[str]:
    """Reshape 1-D PRelu slopes ``[C]`` to ``[C, 1, ...]``; return the nodes changed.

    Before opset 7 a PRelu slope of size C applied along the channel axis (axis 1); from
    opset 7 a slope broadcasts numpy-style from the *last* axis. ONNX's converter keeps the
    slope as it was (measured: onnxruntime then refuses PReLU_1d/2d/3d_multiparam with a
    broadcast error), so the slope gets the trailing unit axes that keep it on the channels.
    """
    import onnx
    from onnx import numpy_helper

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        return []
    ranks = {
        vi.name: len(vi.type.tensor_type.shape.dim)
        for vi in [*inferred.graph.value_info, *inferred.graph.input]
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")
    }
    weights = {t.name: t for t in model.graph.initializer}
    changed = []
    for node in model.graph.node:
        if node.op_type != "PRelu" or len(node.input) < 2 or node.input[1] not in weights:
            continue
        slope = numpy_helper.to_array(weights[node.input[1]])
        rank = ranks.get(node.input[0], 0)
        if slope.ndim == 1 and slope.size > 1 and rank > 2:
            shape = [slope.size, *([1] * (rank - 2))]
            weights[node.input[1]].CopyFrom(numpy_helper.from_array(slope.reshape(shape), node.input[1]))
            for inp in model.graph.input:  # IR 3 lists every weight as an input too, with its shape
                if inp.name == node.input[1] and inp.type.HasField("tensor_type"):
                    del inp.type.tensor_type.shape.dim[:]
                    for d in shape:
                        inp.type.tensor_type.shape.dim.add().dim_value = d
            changed.append(node.name or node.output[0])
    return changed


def upgrade_opset(model: Any, minimum: int = MIN_ONNX_OPSET) -> tuple[Any, dict[str, Any] | None]:
    """Return ``model`` at ``minimum`` when its opset is older, with what was done (None: nothing to do).

    Raises UNSUPPORTED_OPS naming the operator and the opsets when the converter has no adapter for it.
    """
    import onnx
    from onnx import version_converter

    opset = _opset(model)
    if opset is None or opset >= minimum:
        return model, None
    before = {(n.domain or "", n.op_type) for n in model.graph.node}
    aligned = _explicit_broadcasts(model) if opset < 7 else []
    try:
        upgraded = version_converter.convert_version(model, minimum)
        onnx.checker.check_model(upgraded)
    except Exception as exc:  # the converter's own RuntimeError; the checker's ValidationError
        text = str(exc).strip()
        op = re.search(r"(?:for|of) (\w+)", text)
        raise UnsupportedOps(
            f"onnx.version_converter cannot upgrade this opset-{opset} model to opset {minimum}"
            + (f" (at {op.group(1)})" if op else "")
            + f": {text.splitlines()[0][:300] if text else type(exc).__name__}",
            hint="Re-export the model at opset 7 or newer, or target openvino alone, which reads the old opset.",
            ops=[op.group(1)] if op else [],
            opset=opset,
        ) from exc
    fixed = _channel_slopes(upgraded) if opset < 7 else []
    return upgraded, {
        "fixed": aligned + fixed,
        "from": opset,
        "to": minimum,
        "why": f"opset {opset} is older than onnxruntime implements (oldest: {minimum}); "
        "upgraded by onnx.version_converter",
        "ops": sorted(t for d, t in before if d in ("", "ai.onnx")),
    }
