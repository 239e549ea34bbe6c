"""Merge Slices that cut one tensor into consecutive pieces along one axis into a single Split.

Attention blocks cut a fused QKV projection into three (``qkv.chunk(3, -1)``), gated
units into two; exporters write one Slice per piece. Written here because onnxscript's
rule handles only two halves and splits odd sizes the other way round, and onnxslim
has no such fusion.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir

from services.passes._base import KilnPass, PassResult, opset_version
from services.passes._noop_rules import constant_array

__all__ = ["MergeSlicesIntoSplit"]


def _piece(node: ir.Node) -> tuple[int, int, int] | None:
    """Return (axis, start, end) of a unit-step Slice with constant operands and a static axis, else None."""
    if node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 3:
        return None
    x = node.inputs[0]
    if x is None or x.shape is None or len(node.outputs) != 1:
        return None
    starts, ends = constant_array(node.inputs[1]), constant_array(node.inputs[2])
    axes = constant_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else np.array([0])
    steps = constant_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else np.array([1])
    if starts is None or ends is None or axes is None or steps is None:
        return None
    if not (starts.size == ends.size == axes.size == steps.size == 1) or int(steps.reshape(-1)[0]) != 1:
        return None
    rank = x.shape.rank()
    axis = int(axes.reshape(-1)[0])
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        return None
    dim = x.shape[axis]
    if not isinstance(dim, int):
        return None
    # Slice's clamping rules for unit steps: negative indices count from the end, then clamp.
    start, end = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
    start = min(max(start + dim if start < 0 else start, 0), dim)
    end = min(max(end + dim if end < 0 else end, 0), dim)
    return axis, start, end


class MergeSlicesIntoSplit(KilnPass):
    """Replace Slices that tile an axis of one tensor exactly (no gap, no overlap) with one Split."""

    name = "merge_slices"
    summary = "merge Slices that tile one axis of a tensor into a single Split (Kiln pass)"

    def call(self, model: ir.Model) -> PassResult:
        opset = opset_version(model)
        if opset < 13:  # Split takes its sizes as an input from opset 13
            return PassResult(model, False)
        modified = False
        for graph in model.graphs():
            order = {id(node): i for i, node in enumerate(graph)}
            groups: dict[tuple[int, int], list[tuple[int, int, ir.Node]]] = defaultdict(list)
            for node in graph:
                piece = _piece(node)
                if piece is not None:
                    axis, start, end = piece
                    groups[(id(node.inputs[0]), axis)].append((start, end, node))
            for (_, axis), pieces in groups.items():
                modified |= _merge(graph, axis, pieces, order)
        return PassResult(model, modified)


def _merge(graph: ir.Graph, axis: int, pieces: list[tuple[int, int, ir.Node]], order: dict[int, int]) -> bool:
    if len(pieces) < 2:
        return False
    pieces = sorted(pieces, key=lambda p: (p[0], p[1]))
    x = pieces[0][2].inputs[0]
    assert x is not None and x.shape is not None
    dim = x.shape[axis]
    # Exactly tiling [0, dim): each piece starts where the previous ended, none empty.
    bounds = [0] + [end for _, end, _ in pieces]
    if [start for start, _, _ in pieces] != bounds[:-1] or bounds[-1] != dim or any(s >= e for s, e, _ in pieces):
        return False
    if any(node.outputs[0].is_graph_output() for _, _, node in pieces):
        return False  # keeping output names would need renames; rare enough to leave alone
    name, n = f"{x.name}_split_sizes", 0
    while name in graph.initializers:
        n += 1
        name = f"{x.name}_split_sizes_{n}"
    sizes = ir.tensor(np.array([e - s for s, e, _ in pieces], dtype=np.int64), name=name)
    sizes_value = ir.Value(name=sizes.name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([len(pieces)]))
    sizes_value.const_value = sizes
    graph.register_initializer(sizes_value)
    split = ir.node("Split", [x, sizes_value], {"axis": axis}, num_outputs=len(pieces))
    # Split goes where the first Slice was: x is defined before it, every piece is read after.
    first = min((node for _, _, node in pieces), key=lambda n: order[id(n)])
    graph.insert_before(first, split)
    for out, (_, _, node) in zip(split.outputs, pieces, strict=True):
        old = node.outputs[0]
        piece_name, old.name = old.name, None
        out.name, out.type, out.shape = piece_name, old.type, old.shape
        ir.convenience.replace_all_uses_with(old, out)
        graph.remove(node, safe=True)
    return True
