"""What values a model's inputs may take, read from how the ONNX graph uses them.

Generated parity inputs must exercise the model and must be valid for it:

- token ids drawn from a handful of values touch a handful of embedding rows, so a converter
  that broke the rest of the table would pass: an input that indexes a weight table (a
  ``Gather`` whose indices come from it, through casts and reshapes) takes ids over the
  table's rows; one that indexes another tensor of known size (``Gather``,
  ``GatherElements``, ``GatherND``) takes indices within that size;
- an integer input that is a *shape* or a *count* (the shape operand of ``Expand``,
  ``Reshape``, ``Tile``, ``ConstantOfShape``, ``Range``'s bounds, ``Slice``'s starts/ends/axes,
  ``Pad``'s pads, ``TopK``'s k, ``OneHot``'s depth, the axes of a reduction, ...) has no range
  Kiln could guess: random values there are a runtime error in the reference step, so such
  an input is marked as needing real sample data;
- sequence and optional inputs are not tensors Kiln can make up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.runners.base import InputBound

__all__ = ["onnx_input_bounds"]

#: Ops a value passes through unchanged on its way to where it is used.
_VALUE_PRESERVING = frozenset(
    {"Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand", "Transpose", "Slice", "Concat"}
)
#: (op type, input position) -> what an integer there is: a shape, a count or axes, never an id.
_SHAPE_OPERANDS: dict[tuple[str, int], str] = {
    ("Expand", 1): "the shape of an Expand",
    ("Reshape", 1): "the shape of a Reshape",
    ("Tile", 1): "the repeats of a Tile",
    ("ConstantOfShape", 0): "the shape of a ConstantOfShape",
    ("Range", 0): "the start of a Range",
    ("Range", 1): "the limit of a Range",
    ("Range", 2): "the step of a Range",
    ("Slice", 1): "the starts of a Slice",
    ("Slice", 2): "the ends of a Slice",
    ("Slice", 3): "the axes of a Slice",
    ("Slice", 4): "the steps of a Slice",
    ("Pad", 1): "the pads of a Pad",
    ("Pad", 3): "the axes of a Pad",
    ("TopK", 1): "the k of a TopK",
    ("OneHot", 1): "the depth of a OneHot",
    ("Split", 1): "the split sizes of a Split",
    ("Squeeze", 1): "the axes of a Squeeze",
    ("Unsqueeze", 1): "the axes of an Unsqueeze",
    ("Resize", 3): "the sizes of a Resize",
    ("Upsample", 1): "the scales of an Upsample",
    ("NonMaxSuppression", 2): "the box count of a NonMaxSuppression",
    ("ReduceSum", 1): "the axes of a ReduceSum",
    ("ReduceMean", 1): "the axes of a ReduceMean",
    ("ReduceMax", 1): "the axes of a ReduceMax",
    ("ReduceMin", 1): "the axes of a ReduceMin",
    ("ReduceProd", 1): "the axes of a ReduceProd",
    ("CumSum", 1): "the axis of a CumSum",
    ("Trilu", 1): "the diagonal of a Trilu",
}
#: Ops whose input 1 indexes input 0 along an axis (attribute ``axis``, default 0).
_INDEXING = frozenset({"Gather", "GatherElements"})


def onnx_input_bounds(path: Path) -> dict[str, InputBound]:
    """Return what each input of the ONNX model at ``path`` may take, where the graph says so.

    Weights are not loaded: the tables' shapes are in the graph, other tensors' from ONNX's
    shape inference. An input used several ways gets the strictest reading: a shape use makes
    it need sample data; of several index bounds, the smallest.
    """
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # the reference step reports an unreadable model with the engine's own words
        return {}
    graph = model.graph
    shapes = _static_shapes(model)
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    integer = {onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64}
    initializers = {i.name for i in graph.initializer}
    bounds: dict[str, InputBound] = {}
    for inp in graph.input:
        if inp.name in initializers:
            continue
        kind = inp.type.WhichOneof("value")
        if kind in ("sequence_type", "optional_type", "map_type"):
            what = {"sequence_type": "a sequence", "optional_type": "an optional", "map_type": "a map"}[kind]
            bounds[inp.name] = InputBound(0, f"{what} input, which Kiln cannot generate", generatable=False)
            continue
        if inp.type.tensor_type.elem_type not in integer:
            continue
        uses, indexed = _uses(inp.name, consumers, shapes)
        if uses:
            bounds[inp.name] = InputBound(
                0, f"{uses[0]} ({len(uses)} such use{'s' if len(uses) > 1 else ''})", generatable=False
            )
        elif indexed:
            high, what = min(indexed)
            bounds[inp.name] = InputBound(high, f"the {high}-row {what} it indexes")
    return bounds


def _static_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Return the fully static shapes ONNX's shape inference finds (weights' from their dims)."""
    import onnx

    out: dict[str, tuple[int, ...]] = {i.name: tuple(i.dims) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value" and attr.t is not None:
                    out[node.output[0]] = tuple(attr.t.dims)
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a graph shape inference rejects: the weights' shapes are still known
        return out
    for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        dims = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else []
        if dims and all(d.HasField("dim_value") for d in dims):
            out.setdefault(vi.name, tuple(d.dim_value for d in dims))
    return out


def _uses(
    start: str, consumers: dict[str, list[Any]], shapes: dict[str, tuple[int, ...]]
) -> tuple[list[str], list[tuple[int, str]]]:
    """Return (shape-like uses, (rows, what) of each tensor indexed) of ``start`` through value-preserving ops."""
    shape_uses: list[str] = []
    indexed: list[tuple[int, str]] = []
    seen = {start}
    frontier = [start]
    while frontier:
        name = frontier.pop()
        for node in consumers.get(name, ()):
            positions = [i for i, n in enumerate(node.input) if n == name]
            for pos in positions:
                if (node.op_type, pos) in _SHAPE_OPERANDS:
                    shape_uses.append(_SHAPE_OPERANDS[(node.op_type, pos)])
                elif node.op_type in _INDEXING and pos == 1:
                    dims = shapes.get(node.input[0])
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    if dims and -len(dims) <= axis < len(dims) and dims[axis] > 0:
                        what = "table" if len(dims) == 2 and axis == 0 else f"axis {axis} of the tensor"
                        indexed.append((int(dims[axis]), f"{what} {node.input[0]!r}"))
            if node.op_type in _VALUE_PRESERVING and node.input and node.input[0] == name:
                for out in node.output:
                    if out not in seen:
                        seen.add(out)
                        frontier.append(out)
    return shape_uses, indexed
