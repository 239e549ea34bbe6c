"""Fold ``Where(Equal(shape, -1), 1, shape)`` over shape vectors assembled from known-non-negative parts.

TorchScript exports ``x.expand(*sizes)`` as that select: Expand takes 1 where ``expand``
takes -1 ("keep this dimension"). The vector is a Concat of dimensions read with
Shape/Gather (never negative) and constants; onnxscript's folder needs every input constant,
so the chain stays, three nodes per ``expand`` (BERT's attention mask and token types).
Dimensions cannot equal a negative constant, so the select is decided piece by piece.
Written here because neither onnxscript nor onnx_ir folds it (onnxslim does).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from services.passes._base import KilnPass, PassResult
from services.passes._noop_rules import constant_array

__all__ = ["FoldShapeSelects"]

_ONNX = ("", "ai.onnx")
#: Ops whose output is non-negative when their data input is (they move elements, not values).
_MOVES = frozenset({"Unsqueeze", "Squeeze", "Reshape", "Gather", "Slice", "Identity", "Flatten"})


def _non_negative(value: ir.Value | None, depth: int = 6) -> bool:
    """True when ``value`` is an integer tensor of dimensions (made by Shape/Size and moved about)."""
    if value is None or depth == 0 or value.is_graph_input():
        return False
    node = value.producer()
    if node is None or node.domain not in _ONNX:
        return False
    if node.op_type in ("Shape", "Size"):
        return True
    if node.op_type in _MOVES:
        return _non_negative(node.inputs[0], depth - 1)
    if node.op_type == "Concat":
        return all(_non_negative(x, depth - 1) for x in node.inputs)
    return False


def _length(value: ir.Value) -> int | None:
    """Return the static length of a 1-D value, else None."""
    if value.shape is None or value.shape.rank() != 1 or not isinstance(value.shape[0], int):
        return None
    return int(value.shape[0])


def _as_vector(array: np.ndarray | None, n: int) -> np.ndarray | None:
    if array is None or array.ndim > 1 or array.size not in (1, n):
        return None
    return np.broadcast_to(array.reshape(-1), (n,))


def _new_pieces(node: ir.Node) -> list[ir.Value | np.ndarray] | None:
    """Return the Concat pieces that ``node`` (a Where) computes, or None when it is not the pattern."""
    cond, ones, vector = node.inputs
    eq = cond.producer() if cond is not None else None
    if eq is None or eq.op_type != "Equal" or eq.domain not in _ONNX or vector is None or ones is None:
        return None
    if eq.inputs[0] is vector:
        sentinel = constant_array(eq.inputs[1])
    elif eq.inputs[1] is vector:
        sentinel = constant_array(eq.inputs[0])
    else:
        return None
    concat = vector.producer()
    while concat is not None and concat.op_type == "Identity" and concat.inputs[0] is not None:
        concat = concat.inputs[0].producer()  # EliminateNoOps leaves Identities for a later pass
    n = _length(vector)
    if concat is None or concat.op_type != "Concat" or concat.domain not in _ONNX or n is None:
        return None
    sentinel, fill = _as_vector(sentinel, n), _as_vector(constant_array(ones), n)
    if sentinel is None or fill is None or fill.dtype != sentinel.dtype:
        return None
    pieces: list[ir.Value | np.ndarray] = []
    offset = 0
    for piece in concat.inputs:
        if piece is None:
            return None
        const = constant_array(piece)
        size = const.size if const is not None and const.ndim == 1 else _length(piece)
        if size is None or offset + size > n:
            return None
        chunk = slice(offset, offset + size)
        if const is not None:
            pieces.append(np.where(const == sentinel[chunk], fill[chunk], const).astype(const.dtype))
        elif _non_negative(piece) and (sentinel[chunk] < 0).all():
            pieces.append(piece)  # a dimension never equals a negative sentinel: kept as is
        else:
            return None
        offset += size
    return pieces if offset == n else None


class FoldShapeSelects(KilnPass):
    """Replace ``Where(Equal(v, c), a, v)`` over a dimension vector ``v`` with the Concat it evaluates to."""

    name = "fold_shape_selects"
    summary = "fold Where(Equal(shape, -1), 1, shape) of TorchScript's expand when the shape's parts are dimensions"

    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for graph in model.graphs():
            for node in list(graph):
                if node.op_type != "Where" or node.domain not in _ONNX or len(node.inputs) != 3:
                    continue
                pieces = _new_pieces(node)
                if pieces is None or node.outputs[0].is_graph_output():
                    continue
                inputs: list[ir.Value] = []
                for i, piece in enumerate(pieces):
                    if isinstance(piece, np.ndarray):
                        const = ir.node(
                            "Constant",
                            [],
                            {"value": ir.tensor(piece, name=f"{node.outputs[0].name}_part{i}")},
                        )
                        const.outputs[0].const_value = const.attributes["value"].as_tensor()
                        const.outputs[0].type = ir.TensorType(ir.DataType.from_numpy(piece.dtype))
                        const.outputs[0].shape = ir.Shape(piece.shape)
                        graph.insert_before(node, const)
                        inputs.append(const.outputs[0])
                    else:
                        inputs.append(piece)
                out = node.outputs[0]
                if not any(isinstance(piece, np.ndarray) for piece in pieces):
                    replacement = node.inputs[2]  # the select picks the vector itself
                    assert replacement is not None
                else:
                    concat = ir.node("Concat", inputs, {"axis": 0})
                    graph.insert_before(node, concat)
                    replacement = concat.outputs[0]
                    replacement.type, replacement.shape = out.type, out.shape
                ir.convenience.replace_all_uses_with(out, replacement)
                graph.remove(node, safe=True)
                modified = True
        return PassResult(model, modified)
