"""The ONNX graph as TVM's Relax importer needs it: shape operands as constants, weights as parameters.

With ``keep_params_in_input`` (weights leave the library for params.bin) the importer makes
every initializer a function parameter, the int64 shape vectors of a Reshape or an Expand as
much as the weights. Its Reshape converter looks parameters up again (``get_constant``); its
Expand converter and others do not, so a constant target shape is taken for a runtime one,
the output loses its static shape, and the next Reshape with a ``-1`` stops the import with
``Reshape expects the input tensor to have known shape``. Measured on transformers' BERT
exported by torch.onnx: the token-type ``Expand`` did this at open and at pinned axes.
Turning integer initializers (and tiny float ones: Resize scales, Clip bounds, Pad values)
into ``Constant`` nodes gives every converter a constant; weights stay parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["importer_fixes", "prepare_for_import"]

#: Integer and boolean initializers up to this many elements become Constant nodes (shape
#: vectors, index tables, position-id buffers); larger ones stay parameters.
MAX_INLINE_INTEGER = 1 << 20
#: Float initializers up to this many elements become Constant nodes (scales, bounds, epsilons).
MAX_INLINE_FLOAT = 8


def prepare_for_import(model: Any) -> Any:
    """Return a copy of ``model`` (an onnx ModelProto) rewritten where TVM 0.27's ONNX importer stumbles.

    Shape operands become constants (:func:`_inline_shape_operands`); a Split of a shape vector
    becomes Slices and a Tile by a dimension becomes an Expand: the importer's shape-value
    handling takes Slice and Expand but refuses Split and Tile ("cannot handle ShapeExpr
    inputs"). Each rewrite computes the same values.
    """
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    _inline_shape_operands(out)
    _split_shape_vectors(out)
    _tile_by_dimensions(out)
    return out


def _inline_shape_operands(model: Any) -> None:
    """Make ``model``'s integer initializers (and its tiny float ones) Constant nodes, in place."""
    from onnx import TensorProto, helper

    floats = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}
    graph_inputs = {v.name for v in model.graph.input}  # an initializer that is also an input is overridable
    keep, constants = [], []
    for init in model.graph.initializer:
        size = 1
        for d in init.dims:
            size *= d
        limit = MAX_INLINE_FLOAT if init.data_type in floats else MAX_INLINE_INTEGER
        if init.name in graph_inputs or size > limit or init.data_type == TensorProto.STRING:
            keep.append(init)
        else:
            constants.append(helper.make_node("Constant", [], [init.name], value=init))
    if not constants:
        return
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    nodes = [*constants, *model.graph.node]
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _constants(model: Any) -> dict[str, Any]:
    """Return the value of every Constant node's output (numpy arrays), by name."""
    from onnx import numpy_helper

    out = {}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value":
                    out[node.output[0]] = numpy_helper.to_array(attr.t)
    return out


def _static_shapes(model: Any) -> dict[str, list[int | None]]:
    """Return the shapes ONNX shape inference gives every value of ``model`` (None for an unknown dimension)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a model shape inference cannot take keeps its rewrites to what needs no shapes
        inferred = model
    shapes: dict[str, list[int | None]] = {}
    for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        t = v.type.tensor_type
        if t.HasField("shape"):
            shapes[v.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    for name, value in _constants(model).items():
        shapes[name] = list(value.shape)
    return shapes


def _replace_node(model: Any, old: Any, new: list[Any]) -> None:
    nodes = list(model.graph.node)
    at = nodes.index(old)
    del model.graph.node[:]
    model.graph.node.extend([*nodes[:at], *new, *nodes[at + 1 :]])


def _split_shape_vectors(model: Any) -> None:
    """Rewrite ``Split(Shape(x))`` into one Slice per part, in place."""
    from onnx import helper

    producers = {o: n for n in model.graph.node for o in n.output}
    constants = _constants(model)
    for node in list(model.graph.node):
        vector = producers.get(node.input[0]) if node.input else None
        if node.op_type != "Split" or vector is None or vector.op_type != "Shape":
            continue
        sizes = None
        if len(node.input) > 1 and node.input[1] in constants:
            sizes = [int(v) for v in constants[node.input[1]].reshape(-1)]
        for attr in node.attribute:
            if attr.name == "split":
                sizes = list(attr.ints)
        if sizes is None or len(sizes) != len(node.output):
            continue
        new, offset = [], 0
        for i, (size, out) in enumerate(zip(sizes, node.output, strict=True)):
            bounds = [f"{out}_kiln_start", f"{out}_kiln_end", f"{out}_kiln_axis"]
            for name, value in zip(bounds, (offset, offset + size, 0), strict=True):
                new.append(helper.make_node("Constant", [], [name], value=helper.make_tensor(name, 7, [1], [value])))
            new.append(helper.make_node("Slice", [node.input[0], *bounds], [out], name=f"{node.name}_kiln_part{i}"))
            offset += size
        _replace_node(model, node, new)


def _tile_by_dimensions(model: Any) -> None:
    """Rewrite a Tile whose repeats hold one dimension (not a constant) as Unsqueeze, Expand and Reshape, in place.

    ``Tile(x, [batch, 1, 1])`` on ``x`` of static shape ``[4, 32, 8]`` is ``x`` given a new axis
    before axis 0, expanded to ``batch`` along it and merged: ``[batch * 4, 32, 8]``.
    """
    from onnx import helper

    producers = {o: n for n in model.graph.node for o in n.output}
    constants = _constants(model)
    shapes = _static_shapes(model)
    for node in list(model.graph.node):
        if node.op_type != "Tile" or node.input[1] in constants:
            continue
        data_shape = shapes.get(node.input[0])
        concat = producers.get(node.input[1])
        if not data_shape or None in data_shape or concat is None or concat.op_type != "Concat":
            continue
        repeats: list[int | None] = []
        for piece in concat.input:
            if piece in constants:
                repeats += [int(v) for v in constants[piece].reshape(-1)]
            elif shapes.get(piece) == [1]:
                repeats.append(None)  # a dimension, known at run time
            else:
                repeats = []
                break
        open_axes = [i for i, r in enumerate(repeats) if r is None]
        if len(repeats) != len(data_shape) or len(open_axes) != 1 or any(r not in (None, 1) for r in repeats):
            continue
        axis, name = open_axes[0], node.output[0]
        rank = len(data_shape)
        merged = [-1 if i == axis else int(d or 0) for i, d in enumerate(data_shape)]
        one = helper.make_tensor(f"{name}_kiln_one", 7, [1], [1])
        new = [
            helper.make_node("Constant", [], [f"{name}_kiln_axis"], value=helper.make_tensor("a", 7, [1], [axis])),
            helper.make_node("Unsqueeze", [node.input[0], f"{name}_kiln_axis"], [f"{name}_kiln_unsqueezed"]),
            helper.make_node("Constant", [], [f"{name}_kiln_one"], value=one),
            helper.make_node("Constant", [], [f"{name}_kiln_from"], value=helper.make_tensor("f", 7, [1], [axis])),
            helper.make_node("Constant", [], [f"{name}_kiln_to"], value=helper.make_tensor("t", 7, [1], [axis + 1])),
            helper.make_node("Slice", [node.input[1], f"{name}_kiln_from", f"{name}_kiln_to"], [f"{name}_kiln_rep"]),
            helper.make_node(
                "Concat",
                [*[f"{name}_kiln_one"] * axis, f"{name}_kiln_rep", *[f"{name}_kiln_one"] * (rank - axis)],
                [f"{name}_kiln_target"],
                axis=0,
            ),
            helper.make_node("Expand", [f"{name}_kiln_unsqueezed", f"{name}_kiln_target"], [f"{name}_kiln_expanded"]),
            helper.make_node(
                "Constant",
                [],
                [f"{name}_kiln_shape"],
                value=helper.make_tensor("s", 7, [rank], merged),
            ),
            helper.make_node("Reshape", [f"{name}_kiln_expanded", f"{name}_kiln_shape"], [name], name=node.name),
        ]
        _replace_node(model, node, new)


def _range_of_dimensions(original: Any) -> Any:
    """Return TVM's ONNX Range converter, giving ``arange`` over dimension bounds a length of their expression.

    TVM 0.27 gives a Range with a runtime bound a fresh length variable (``range_len_0``) that
    Relax cannot prove equal to the dimension it came from: positions ``arange(sequence)``
    broadcast against ``[batch, heads, sequence, dim]`` then lose their shape (every causal
    LM's rotary embedding; the next Expand fails with ``'NoneType' object is not iterable``).
    ``relax.op.arange`` over the same dimensions keeps ``sequence`` as the length. Bounds that
    are tensors, float ranges and steps other than 1 go to TVM's own converter.
    """
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx.onnx_frontend import get_constant

    def bound(x: Any, params: Any) -> Any:
        x = get_constant(x, params)
        if isinstance(x, tvm.ir.GenericConst):
            value = x.value.numpy()
            return int(value.item()) if value.size == 1 and value.dtype.kind in "iu" else None
        return x if tvm.ir.is_prim_expr(x) and str(x.ty) in ("int64", "int32") else None

    def convert(cls: Any, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
        start, limit, delta = (bound(x, params) for x in inputs[:3])
        dims = [x for x in (start, limit) if x is not None and not isinstance(x, int)]
        if start is None or limit is None or delta != 1 or not dims:
            return original(cls, bb, inputs, attr, params)
        return relax.op.arange(start, limit, 1, "int64")

    return convert


def _reshape_of_a_dimension(original: Any) -> Any:
    """Return TVM's ONNX Reshape converter, taking a dimension (a scalar PrimExpr such as ``4 * batch``) as a tensor.

    The importer keeps arithmetic on dimensions as PrimExprs; its Reshape converter takes a
    shape vector or a tensor and refuses a scalar dimension ("Reshape expects the input data
    to be a Tensor", DeBERTa-v2's relative positions). The dimension becomes a 0-d int64 tensor first.
    """
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx.onnx_frontend import get_constant

    def convert(cls: Any, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
        data = inputs[0]
        if tvm.ir.is_prim_expr(data) and not isinstance(data, tvm.ir.GenericConst):
            target = get_constant(inputs[1], params)
            if isinstance(target, tvm.ir.GenericConst):
                dims = target.value.numpy().reshape(-1).tolist()
                if dims in ([1], [-1]):
                    return relax.ShapeExpr([data])  # a one-dimension shape vector, as Shape -> Gather -> Unsqueeze
                if dims == []:
                    return data
            vector = bb.normalize(relax.op.shape_to_tensor(relax.ShapeExpr([data])))
            inputs = [bb.normalize(relax.op.reshape(vector, ())), *inputs[1:]]
        return original(cls, bb, inputs, attr, params)

    return convert


#: (converter class, its implementation attribute, Kiln's wrapper of it)
_FIXES = (("Range", "_impl_v12", _range_of_dimensions), ("Reshape", "_impl_v13", _reshape_of_a_dimension))


@contextlib.contextmanager
def importer_fixes() -> Iterator[None]:
    """Swap in Kiln's fixes to TVM's ONNX converters while a model is imported (one import at a time)."""
    from tvm.relax.frontend.onnx import onnx_frontend as frontend

    saved = [(getattr(frontend, cls), attr, getattr(frontend, cls).__dict__[attr]) for cls, attr, _ in _FIXES]
    for (converter, attr, original), (_, _, fix) in zip(saved, _FIXES, strict=True):
        setattr(converter, attr, classmethod(fix(original.__func__)))
    try:
        yield
    finally:
        for converter, attr, original in saved:
            setattr(converter, attr, original)
