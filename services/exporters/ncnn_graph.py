"""Rewrite an ONNX graph into operators pnnx lowers to ncnn layers: transformers' exports, at fixed shapes.

pnnx converts a graph at the fixed shapes it traces (batch 1, the reference samples' lengths),
and ncnn has no layer for several operators transformers' exports are made of (measured on
the ten families of issue 30: ``pnnx left operators ncnn cannot run: Gather, GatherND,
Tensor.to, torch.logical_and, torch.where``). At those fixed shapes most of them are not
needed:

- **shapes pinned, shape arithmetic folded** (services/passes/pinned_shapes.py): the causal
  mask, sliding windows, T5's and DeBERTa's relative-position buckets, rotary tables and
  Swin's shift masks depend only on the sequence length and become constants;
- **gathers with constant indices** (``x[:, 0]``, ``as_strided``, the padding mask's
  ``attention_mask[batch_idx, kv_idx]``, a GatherND) whose flat positions form an affine,
  dense map of the output are a Reshape / Slice / Transpose / Expand of the data;
- **boolean masks computed from an input** (``attention_mask`` cast to bool, ``&`` with the
  causal mask, ``where(mask, 0, min)``) become float arithmetic on 0/1 values, exact there:
  ``bool(x) = min(|x|, 1)`` on integers, ``and = a*b``, ``or = max(a, b)``, ``not = 1-a``,
  ``where(c, x, y) = c*x + (1-c)*y`` with infinite branches clipped to float32's largest
  magnitude (``0 * inf`` is NaN); ncnn blobs are float32 anyway;
- **DeBERTa's relative-position gathers** (GatherElements along the last axis, the same
  constant indices for every head) become a nearest-neighbour GridSample at those positions;
- **an embedding lookup** ``Gather(table, ids)``: pnnx matches ONNX's Gather as an embedding
  (ncnn's ``Embed``) only without an explicit ``axis`` attribute, which the exporters write
  (and a table of fewer than 8 rows gets zero rows: pnnx probes every id at 7);
- **an integer input only ever cast to float** (the attention mask, once the masks are
  arithmetic) is declared float: ncnn blobs are float32, and pnnx keeps the Cast as
  ``Tensor.to``, which ncnn has no layer for;
- **a linear layer over flattened rows** (GPT-2's Conv1D: Reshape, Gemm, Reshape back) is
  one MatMul on the unflattened tensor, which keeps the batch axis where pnnx finds it;
- **LayerNormalization without a bias** (ModernBERT) gets a zero one: pnnx lowers only the
  biased form to ncnn's LayerNorm;
- **a Transpose of more than 4 axes** (Swin's window partition, 6-D): axes that stay adjacent
  and in order are merged and size-1 axes dropped around it (ncnn holds at most 4 per sample);
- **a one-axis reduction** (RMSNorm's mean, a pooling mean) reduces over one more, size-1
  axis: pnnx reads a one-element ``axes`` as a scalar and writes an ncnn Reduction that reduces
  nothing (its ncnn pass reads the list form only);
- **an integer power** ``x ** 3`` (the tanh GELU) is written as products: ncnn's pow of a
  negative base is not finite;
- **a strided Slice** (Swin's patch merging, ``x[:, 0::2]``): a Reshape that splits the axis
  into (count, step) and a contiguous Slice (ncnn's Crop has no step).

What remains is named by the exporter's "pnnx left operators" error: a gather whose indices
depend on the input, a comparison of computed values, DeBERTa's GatherElements over the
attention scores (constant indices, but not an affine map).

:func:`ncnn_ready_onnx` checks its rewrite with onnxruntime against the pinned graph on one
sample before pnnx sees it, so a rewrite that would change a result is never used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["RewriteReport", "rewrite_for_ncnn"]

#: ncnn's Mat holds at most 4 axes (w, h, d, c) per sample.
NCNN_MAX_AXES = 4
_FLOAT_MAX = float(np.finfo(np.float32).max)


@dataclass
class RewriteReport:
    """What :func:`rewrite_for_ncnn` changed, rewrite by rewrite (name -> count)."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, n: int = 1) -> None:
        if n:
            self.counts[name] = self.counts.get(name, 0) + n

    def notes(self) -> list[str]:
        return [f"{name}: {n}" for name, n in self.counts.items()]


class _Graph:
    """An ONNX graph with what the rewrites ask of it: producers, consumers, constants, static types."""

    def __init__(self, model: Any) -> None:
        import onnx

        self.onnx = onnx
        self.model = model
        self.graph = model.graph
        self._fresh = 0
        self.refresh()

    def refresh(self) -> None:
        from onnx import numpy_helper

        inferred = self.onnx.shape_inference.infer_shapes(self.model, data_prop=True)
        self.types: dict[str, tuple[int, tuple[int | None, ...] | None]] = {}
        for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
            t = vi.type.tensor_type
            shape = None
            if t.HasField("shape"):
                shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
            self.types[vi.name] = (t.elem_type, shape)
        self.consts: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in self.graph.initializer}
        for node in self.graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.attribute:
                attr = node.attribute[0]
                if attr.name == "value":
                    self.consts[node.output[0]] = numpy_helper.to_array(attr.t)
        for init in self.graph.initializer:
            self.types[init.name] = (init.data_type, tuple(init.dims))
        self.producer = {o: n for n in self.graph.node for o in n.output}
        self.consumers: dict[str, list[Any]] = {}
        for node in self.graph.node:
            for i in node.input:
                self.consumers.setdefault(i, []).append(node)
        self.outputs = {o.name for o in self.graph.output}

    def shape(self, name: str) -> tuple[int, ...] | None:
        """Return the static shape of ``name``, or None when any axis is unknown."""
        if name in self.consts:
            return tuple(self.consts[name].shape)
        shape = self.types.get(name, (0, None))[1]
        if shape is None or any(d is None for d in shape):
            return None
        return tuple(int(d) for d in shape)  # type: ignore[arg-type]

    def elem(self, name: str) -> int:
        if name in self.consts:
            return int(self.onnx.helper.np_dtype_to_tensor_dtype(self.consts[name].dtype))
        return self.types.get(name, (0, None))[0]

    def fresh(self, hint: str) -> str:
        self._fresh += 1
        return f"kiln_ncnn_{hint}_{self._fresh}"

    def const(self, array: np.ndarray, hint: str = "c") -> str:
        name = self.fresh(hint)
        self.graph.initializer.append(self.onnx.numpy_helper.from_array(np.asarray(array), name))
        self.consts[name] = np.asarray(array)
        return name

    def node(self, op: str, inputs: list[str], hint: str, **attrs: Any) -> tuple[Any, str]:
        out = self.fresh(hint)
        return self.onnx.helper.make_node(op, inputs, [out], name=out, **attrs), out

    def replace(self, old: Any, new: list[Any], output: str | None = None) -> None:
        """Put ``new`` where ``old`` was; ``output`` (the last new node's) takes over ``old``'s output name."""
        nodes = list(self.graph.node)
        at = nodes.index(old)
        if output is not None:
            for n in new:
                for k, name in enumerate(n.output):
                    if name == output:
                        n.output[k] = old.output[0]
                for k, name in enumerate(n.input):
                    if name == output:
                        n.input[k] = old.output[0]
        del self.graph.node[at]
        for k, n in enumerate(new):
            self.graph.node.insert(at + k, n)


def _is_onnx(node: Any) -> bool:
    return node.domain in ("", "ai.onnx")


# --- gathers with constant indices ---------------------------------------------------------


def _flat_positions(g: _Graph, node: Any) -> np.ndarray | None:
    """Return, for a gather with constant indices over static data, the flat data position of each output element."""
    data_shape = g.shape(node.input[0])
    if data_shape is None or len(node.input) < 2 or node.input[1] not in g.consts:
        return None
    idx = g.consts[node.input[1]].astype(np.int64)
    positions = np.arange(int(np.prod(data_shape)), dtype=np.int64).reshape(data_shape)
    attrs = {a.name: g.onnx.helper.get_attribute_value(a) for a in node.attribute}
    try:
        if node.op_type == "Gather":
            axis = int(attrs.get("axis", 0))
            return np.take(positions, np.where(idx < 0, idx + data_shape[axis], idx), axis=axis)
        if node.op_type == "GatherElements":
            axis = int(attrs.get("axis", 0))
            return np.take_along_axis(positions, np.where(idx < 0, idx + data_shape[axis], idx), axis=axis)
        if node.op_type == "GatherND" and int(attrs.get("batch_dims", 0)) == 0:
            k = idx.shape[-1]
            sizes = np.asarray(data_shape[:k])
            idx = np.where(idx < 0, idx + sizes, idx)
            return positions[tuple(np.moveaxis(idx, -1, 0))]
    except IndexError:
        return None
    return None


def _affine_dense(flat: np.ndarray) -> tuple[int, list[int]] | None:
    """Return (offset, stride per output axis) when ``flat[o] = offset + sum(o_a * stride_a)``, else None."""
    if flat.size == 0:
        return None
    offset = int(flat.reshape(-1)[0])
    strides = []
    for axis, n in enumerate(flat.shape):
        if n == 1:
            strides.append(0)
            continue
        step = [0] * flat.ndim
        step[axis] = 1
        strides.append(int(flat[tuple(step)]) - offset)
    grid = np.indices(flat.shape).reshape(flat.ndim, -1)
    if not np.array_equal(offset + np.asarray(strides) @ grid, flat.reshape(-1)):
        return None
    return offset, strides


_DENSE = "constant-index gather as slice/reshape"
_GRID = "constant-index row gather as nearest GridSample"


def _rewrite_gather(g: _Graph, node: Any) -> str:
    """Replace a gather with constant indices by Reshape / Slice / Transpose / Expand when its map is dense,
    or by a GridSample (see below); return which, or "" when it is left."""
    flat = _flat_positions(g, node)
    if flat is None:
        return ""
    if node.op_type == "Gather" and g.consts[node.input[1]].ndim == 0:
        return ""  # a scalar index is x.select(): pnnx lowers it to Crop itself
    found = _affine_dense(flat)
    if found is None:
        grid = node.op_type == "GatherElements" and _gather_rows_as_grid_sample(g, node)
        return _GRID if grid else ""
    offset, strides = found
    out_shape = list(flat.shape)
    moving = sorted((a for a, s in enumerate(strides) if s > 0), key=lambda a: -strides[a])
    if any(s < 0 for s in strides):
        return ""
    # Dense: the moving axes, largest stride first, tile a contiguous block of the flat data.
    expect = 1
    for a in reversed(moving):
        if strides[a] != expect:
            return ""
        expect *= out_shape[a]
    count = expect
    new = []
    n1, flat_data = g.node("Reshape", [node.input[0], g.const(np.array([-1], np.int64), "shape")], "flat")
    n2, block = g.node(
        "Slice",
        [
            flat_data,
            g.const(np.array([offset], np.int64), "start"),
            g.const(np.array([offset + count], np.int64), "end"),
            g.const(np.array([0], np.int64), "axes"),
        ],
        "block",
    )
    block_shape = [out_shape[a] for a in moving] or [1]
    n3, shaped = g.node("Reshape", [block, g.const(np.array(block_shape, np.int64), "shape")], "block")
    new += [n1, n2, n3]
    last = shaped
    if len(moving) > 1 and moving != sorted(moving):
        order = sorted(range(len(moving)), key=lambda k: moving[k])
        n4, last = g.node("Transpose", [last], "order", perm=order)
        new.append(n4)
    # Broadcast axes (stride 0) come back as size 1, then Expand to the output shape.
    with_ones = [out_shape[a] if strides[a] > 0 else 1 for a in range(len(out_shape))]
    n5, last = g.node("Reshape", [last, g.const(np.array(with_ones, np.int64), "shape")], "axes")
    new.append(n5)
    if with_ones != out_shape:
        n6, last = g.node("Expand", [last, g.const(np.array(out_shape, np.int64), "shape")], "expand")
        new.append(n6)
    g.replace(node, new, last)
    return _DENSE


def _gather_rows_as_grid_sample(g: _Graph, node: Any) -> bool:
    """Replace ``out[..., i, j] = data[..., i, idx[i, j]]`` (GatherElements on the last axis, constant indices
    alike for every leading position) by a nearest-neighbour GridSample at those integer positions.

    DeBERTa's disentangled attention reads its relative-position scores so; the indices are
    log-bucketed, not an affine map. GridSample (ncnn's layer of that name) samples every channel
    at the same (x, y): the leading axes become channels, row i is sampled at y = i and
    x = idx[i, j]; at integer positions with corners aligned, nearest sampling reads the element.
    """
    data_shape = g.shape(node.input[0])
    idx = g.consts[node.input[1]].astype(np.int64)
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    if data_shape is None or len(data_shape) < 2 or axis % len(data_shape) != len(data_shape) - 1:
        return False
    if (
        g.model.opset_import
        and max((o.version for o in g.model.opset_import if o.domain in ("", "ai.onnx")), default=0) < 16
    ):
        return False  # GridSample is opset 16
    if tuple(idx.shape[:-1]) != tuple(data_shape[:-1]):
        return False
    rows, width = data_shape[-2], data_shape[-1]
    idx = np.where(idx < 0, idx + width, idx)
    plane = idx.reshape(-1, rows, idx.shape[-1])
    if not (plane == plane[:1]).all():
        return False
    channels = int(np.prod(data_shape[:-2]))
    cols = idx.shape[-1]

    def normalised(position: np.ndarray, size: int) -> np.ndarray:
        return np.zeros_like(position, np.float32) if size == 1 else (2.0 * position / (size - 1) - 1.0)

    ys = np.broadcast_to(np.arange(rows)[:, None], (rows, cols))
    grid = np.stack([normalised(plane[0], width), normalised(ys, rows)], axis=-1).astype(np.float32)[None]
    r1, x = g.node("Reshape", [node.input[0], g.const(np.array([1, channels, rows, width], np.int64))], "planes")
    gs, y = g.node(
        "GridSample", [x, g.const(grid, "grid")], "gather", mode="nearest", padding_mode="border", align_corners=1
    )
    r2, z = g.node("Reshape", [y, g.const(np.array(idx.shape, np.int64))], "gathered")
    g.replace(node, [r1, gs, r2], z)
    return True


# --- boolean masks as float arithmetic -----------------------------------------------------

_BOOL = 9
_FLOAT = 1
#: Ops that move or copy elements without looking at their values.
_MOVES = frozenset(
    {"Reshape", "Expand", "Unsqueeze", "Squeeze", "Transpose", "Slice", "Concat", "Identity", "Flatten", "Tile"}
)
_LOGIC = {"And": "Mul", "Or": "Max"}


def _bool_values(g: _Graph) -> set[str] | None:
    """Return the boolean values computed from graph inputs, or None when one meets an op this cannot rewrite."""
    dynamic: set[str] = set()
    for node in g.graph.node:
        if not _is_onnx(node):
            continue
        outs = [o for o in node.output if g.elem(o) == _BOOL and o not in g.consts]
        if not outs:
            continue
        ins = [i for i in node.input if i and i not in g.consts]
        if not ins:
            continue  # constant: folded or left alone
        if node.op_type == "Cast":
            if g.elem(node.input[0]) not in (1, 6, 7, 10, 11, _BOOL):  # float, int32, int64, half, double
                return None
            dynamic.update(outs)
        elif node.op_type in _LOGIC or node.op_type in ("Not", "Xor") or node.op_type in _MOVES:
            dynamic.update(outs)
        else:
            return None  # a comparison of computed values, and such: not exact as float arithmetic
    for name in dynamic:
        for user in g.consumers.get(name, []):
            ok = user.op_type in _LOGIC or user.op_type in ("Not", "Xor", "Where", "Cast") or user.op_type in _MOVES
            if user.op_type == "Where" and (user.input[0] != name or g.elem(user.output[0]) != _FLOAT):
                ok = False  # the mask as a branch, or a where over integers
            if not ok or name in g.outputs:
                return None
    return dynamic


def _finite(g: _Graph, name: str) -> str:
    """Return ``name``, or a copy of its constant with infinities clipped to float32's largest magnitude."""
    if name in g.consts and np.isinf(g.consts[name]).any():
        value = np.clip(g.consts[name], -_FLOAT_MAX, _FLOAT_MAX).astype(g.consts[name].dtype)
        return g.const(value, "finite")
    return name


def _as_float(g: _Graph, name: str, new: list[Any]) -> str:
    """Return ``name`` as float32: a boolean constant converted, a computed mask as it is (already rewritten)."""
    if name in g.consts and g.consts[name].dtype == np.bool_:
        return g.const(g.consts[name].astype(np.float32), "mask")
    return name


def _rewrite_masks(g: _Graph, report: RewriteReport) -> None:
    masks = _bool_values(g)
    if not masks:
        return
    one = g.const(np.array(1.0, np.float32), "one")
    for node in list(g.graph.node):
        if not _is_onnx(node):
            continue
        new: list[Any] = []
        if node.op_type == "Cast" and node.output[0] in masks:
            x = node.input[0]
            if g.elem(x) == _BOOL and x in masks:
                g.replace(node, [g.onnx.helper.make_node("Identity", [x], [node.output[0]], name=node.name)])
                continue
            if g.elem(x) != _FLOAT:
                n, x = g.node("Cast", [x], "float", to=_FLOAT)
                new.append(n)
            a, x = g.node("Abs", [x], "abs")
            m, x = g.node("Min", [x, one], "bool")
            g.replace(node, [*new, a, m], x)
            report.add("boolean mask as float arithmetic")
        elif node.op_type in _LOGIC and node.output[0] in masks:
            ins = [_as_float(g, i, new) for i in node.input]
            n, out = g.node(_LOGIC[node.op_type], ins, node.op_type.lower())
            g.replace(node, [n], out)
        elif node.op_type == "Not" and node.output[0] in masks:
            n, out = g.node("Sub", [one, _as_float(g, node.input[0], new)], "not")
            g.replace(node, [n], out)
        elif node.op_type == "Xor" and node.output[0] in masks:
            s, d = g.node("Sub", [_as_float(g, i, new) for i in node.input], "xor")
            a, out = g.node("Abs", [d], "xor")
            g.replace(node, [s, a], out)
        elif node.op_type == "Where" and node.input[0] in masks:
            cond = node.input[0]
            x, y = _finite(g, node.input[1]), _finite(g, node.input[2])
            mx, cx = g.node("Mul", [cond, x], "where_x")
            inv, notc = g.node("Sub", [one, cond], "where_not")
            my, cy = g.node("Mul", [notc, y], "where_y")
            add, out = g.node("Add", [cx, cy], "where")
            g.replace(node, [mx, inv, my, add], out)
            report.add("where() as c*x + (1-c)*y")
        elif node.op_type == "Cast" and node.input[0] in masks:
            to = next(a.i for a in node.attribute if a.name == "to")
            if to == _FLOAT:
                g.replace(
                    node, [g.onnx.helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name)]
                )
            else:
                node.attribute[0].i = to  # float -> the type asked for, as bool -> that type was
        elif node.op_type in _MOVES and node.output[0] in masks and node.op_type == "Concat":
            for k, name in enumerate(node.input):
                node.input[k] = _as_float(g, name, new)
    # Every rewritten mask is float now: its recorded type must say so, for onnxruntime and pnnx.
    for vi in g.graph.value_info:
        if vi.name in masks:
            vi.type.tensor_type.elem_type = _FLOAT


# --- the smaller rewrites ------------------------------------------------------------------


#: The value pnnx's shape inference feeds every int64 input when it runs the graph in onnxruntime.
PNNX_PROBE_ID = 7


def _embedding_gathers(g: _Graph) -> int:
    """Drop ``axis=0`` from Gather(2-D table, computed ids): pnnx's embedding pattern has no attributes.

    A table of fewer than 8 rows (BERT's two token types) gets zero rows up to 8: pnnx runs the
    graph in onnxruntime with every id at 7 to infer shapes, and onnxruntime refuses the
    out-of-range lookup (pnnx then crashes). Valid ids never reach the added rows.
    """
    n = 0
    for node in g.graph.node:
        if node.op_type != "Gather" or not _is_onnx(node) or node.input[0] not in g.consts:
            continue
        table = g.consts[node.input[0]]
        if table.ndim != 2 or node.input[1] in g.consts:
            continue
        axis = [a for a in node.attribute if a.name == "axis"]
        if axis and axis[0].i != 0:
            continue
        if axis:
            node.attribute.remove(axis[0])
        if table.shape[0] <= PNNX_PROBE_ID:
            padded = np.zeros((PNNX_PROBE_ID + 1, table.shape[1]), table.dtype)
            padded[: table.shape[0]] = table
            node.input[0] = g.const(padded, "table")
        n += 1
    return n


def _layer_norm_biases(g: _Graph) -> int:
    n = 0
    for node in g.graph.node:
        if node.op_type != "LayerNormalization" or not _is_onnx(node) or (len(node.input) >= 3 and node.input[2]):
            continue
        scale = g.consts.get(node.input[1]) if len(node.input) > 1 else None
        if scale is None:
            continue
        zeros = g.const(np.zeros_like(scale), "ln_bias")
        if len(node.input) == 3:
            node.input[2] = zeros
        else:
            node.input.append(zeros)
        n += 1
    return n


def _merged_transpose(shape: tuple[int, ...], perm: list[int]) -> tuple[list[int], list[int]] | None:
    """Return (input shape, perm) of an equivalent Transpose with size-1 axes dropped and adjacent runs merged."""
    keep = [a for a in range(len(shape)) if shape[a] != 1]
    order = [a for a in perm if shape[a] != 1]
    groups: list[list[int]] = []
    for a in order:
        if groups and groups[-1][-1] + 1 == a and keep.index(a) == keep.index(groups[-1][-1]) + 1:
            groups[-1].append(a)
        else:
            groups.append([a])
    by_input = sorted(groups, key=lambda grp: grp[0])
    new_shape = [int(np.prod([shape[a] for a in grp])) for grp in by_input]
    new_perm = [by_input.index(grp) for grp in groups]
    return (new_shape or [1]), (new_perm or [0])


def _high_rank_transposes(g: _Graph) -> int:
    n = 0
    for node in list(g.graph.node):
        if node.op_type != "Transpose" or not _is_onnx(node):
            continue
        shape = g.shape(node.input[0])
        if shape is None or len(shape) <= NCNN_MAX_AXES:
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), list(range(len(shape)))[::-1])
        merged = _merged_transpose(shape, perm)
        if merged is None or len(merged[0]) > NCNN_MAX_AXES:
            continue
        new_shape, new_perm = merged
        out_shape = [shape[a] for a in perm]
        r1, x = g.node("Reshape", [node.input[0], g.const(np.array(new_shape, np.int64), "shape")], "merge")
        t, x = g.node("Transpose", [x], "merged", perm=new_perm)
        r2, x = g.node("Reshape", [x, g.const(np.array(out_shape, np.int64), "shape")], "split")
        g.replace(node, [r1, t, r2], x)
        n += 1
    return n


def _reshape_chains(g: _Graph) -> int:
    """Fold Reshape(Reshape(x, a), b) into Reshape(x, b) when the inner one feeds only the outer (static b)."""
    n = 0
    for node in list(g.graph.node):
        if node.op_type != "Reshape" or not _is_onnx(node) or node.input[1] not in g.consts:
            continue
        inner = g.producer.get(node.input[0])
        if inner is None or inner.op_type != "Reshape" or not _is_onnx(inner):
            continue
        if len(g.consumers.get(inner.output[0], [])) != 1 or inner.output[0] in g.outputs:
            continue
        if np.any(g.consts[node.input[1]] == 0):
            continue  # 0 copies an axis of the input, which the inner Reshape decides
        node.input[0] = inner.input[0]
        g.graph.node.remove(inner)
        g.refresh()
        n += 1
    return n


def _strided_slices(g: _Graph) -> int:
    n = 0
    for node in list(g.graph.node):
        if node.op_type != "Slice" or not _is_onnx(node) or len(node.input) < 5:
            continue
        shape = g.shape(node.input[0])
        if shape is None or any(i not in g.consts for i in node.input[1:5]):
            continue
        starts, ends, axes, steps = (g.consts[i].astype(np.int64).reshape(-1) for i in node.input[1:5])
        if len(axes) != 1 or steps[0] <= 1:
            continue
        axis = int(axes[0]) % len(shape)
        size, step = shape[axis], int(steps[0])
        start = int(starts[0]) + size if starts[0] < 0 else int(starts[0])
        end = min(int(ends[0]) + size if ends[0] < 0 else int(ends[0]), size)
        if size % step or not 0 <= start < step or end < size:
            continue  # the simple case only: every step-th element from one of the first ``step``
        pre, post = int(np.prod(shape[:axis])), int(np.prod(shape[axis + 1 :]))
        out_shape = list(shape)
        out_shape[axis] = size // step
        r1, x = g.node(
            "Reshape", [node.input[0], g.const(np.array([pre * (size // step), step, post], np.int64))], "split"
        )
        s, x = g.node(
            "Slice",
            [
                x,
                g.const(np.array([start], np.int64)),
                g.const(np.array([start + 1], np.int64)),
                g.const(np.array([1], np.int64)),
            ],
            "phase",
        )
        r2, x = g.node("Reshape", [x, g.const(np.array(out_shape, np.int64))], "strided")
        g.replace(node, [r1, s, r2], x)
        n += 1
    return n


#: Integer arithmetic that float32 computes exactly on the small integers an attention mask holds.
_EXACT_ARITHMETIC = frozenset({"Mul", "Add", "Sub", "Neg", "Abs", "Max", "Min"})


def _float_inputs(g: _Graph) -> int:
    """Make an integer input that is only ever cast to float (after reshapes, or products with other
    masks) a float input: ncnn blobs are float32 already, and pnnx keeps the Cast as ``Tensor.to``,
    which ncnn has no layer for (an attention mask; DeBERTa multiplies two views of it first)."""
    n = 0
    for value in g.graph.input:
        t = value.type.tensor_type
        if t.elem_type not in (6, 7) or value.name in g.consts:  # int32, int64
            continue
        reached, casts, ops, frontier, ok = {value.name}, [], [], [value.name], True
        while frontier and ok:
            name = frontier.pop()
            users = g.consumers.get(name, [])
            if not users or name in g.outputs:
                ok = False
            for user in users:
                if not _is_onnx(user):
                    ok = False
                elif user.op_type == "Cast" and user.attribute[0].i == _FLOAT:
                    casts.append(user)
                elif (user.op_type in _MOVES and user.op_type != "Concat" and user.input[0] == name) or (
                    user.op_type in _EXACT_ARITHMETIC
                ):
                    if user.output[0] not in reached:
                        reached.add(user.output[0])
                        ops.append(user)
                        frontier.append(user.output[0])
                else:
                    ok = False
        # Every other operand of the arithmetic must be reached too, or a constant (made float).
        ok = ok and all(
            i in reached or i in g.consts for op in ops if op.op_type in _EXACT_ARITHMETIC for i in op.input
        )
        if not ok or not casts:
            continue
        t.elem_type = _FLOAT
        for op in ops:
            if op.op_type in _EXACT_ARITHMETIC:
                for k, name in enumerate(op.input):
                    if name in g.consts and name not in reached:
                        op.input[k] = g.const(g.consts[name].astype(np.float32), "float")
        for cast in casts:
            g.replace(cast, [g.onnx.helper.make_node("Identity", [cast.input[0]], [cast.output[0]], name=cast.name)])
        n += 1
    return n


def _integer_powers(g: _Graph) -> int:
    """Write ``x ** k`` for a constant integer k in 2..4 as products: ncnn's pow of a negative base is not
    finite (its x86 kernel goes through exp(log x)), and the tanh GELU cubes negative values (Gemma-2)."""
    n = 0
    for node in list(g.graph.node):
        if node.op_type != "Pow" or not _is_onnx(node) or node.input[1] not in g.consts:
            continue
        k = g.consts[node.input[1]]
        if k.size != 1 or float(k.reshape(-1)[0]) not in (2.0, 3.0, 4.0):
            continue
        x, new = node.input[0], []
        product = x
        for _ in range(int(k.reshape(-1)[0]) - 1):
            m, product = g.node("Mul", [product, x], "pow")
            new.append(m)
        g.replace(node, new, product)
        n += 1
    return n


_REDUCES = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd"})


def _single_axis_reduces(g: _Graph) -> int:
    """Give a one-axis reduction (axes as an input, opset >= 18) two axes: a trailing size-1 axis added for it.

    pnnx reads a one-element ``axes`` input as a scalar ``dim``, and its ncnn pass reads the
    list form only: the Reduction it writes reduces nothing (T5's and Llama's RMSNorm means,
    DINOv2's pooling). Over ``[axis, new]`` it writes the list; the mean, sum, max... over one
    more axis of size one is the same number.
    """
    n = 0
    for node in list(g.graph.node):
        if node.op_type not in _REDUCES or not _is_onnx(node) or len(node.input) < 2 or node.input[1] not in g.consts:
            continue
        axes = g.consts[node.input[1]].reshape(-1)
        shape, out = g.shape(node.input[0]), g.shape(node.output[0])
        if axes.size != 1 or shape is None or out is None or len(shape) > NCNN_MAX_AXES:  # + 1 axis: 4 per sample
            continue
        rank = len(shape)
        u, x = g.node("Unsqueeze", [node.input[0], g.const(np.array([rank], np.int64))], "unsq")
        axis = int(axes[0]) % rank
        r, y = g.node(
            node.op_type,
            [x, g.const(np.array([axis, rank], np.int64))],
            "reduce",
            **{a.name: g.onnx.helper.get_attribute_value(a) for a in node.attribute},
        )
        back, z = g.node("Reshape", [y, g.const(np.array(out, np.int64))], "reduced")
        g.replace(node, [u, r, back], z)
        n += 1
    return n


def _batched_linears(g: _Graph) -> int:
    """Replace Reshape(x, [rows, K]) -> Gemm(., W[, b]) -> Reshape(., [*lead, N]) by MatMul(x, W) [+ b].

    GPT-2's Conv1D flattens the batch into the rows of a matrix product and back: pnnx then
    loses which axis is the batch and keeps it as a real axis of size one, so a key that is
    concatenated with a past-key input (which has none) lands on the wrong axis. The product
    on the unflattened tensor is the same numbers and keeps the batch axis where pnnx finds it.
    """
    n = 0
    for node in list(g.graph.node):
        if node.op_type != "Gemm" or not _is_onnx(node) or node.input[1] not in g.consts:
            continue
        attrs = {a.name: g.onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            continue
        flat = g.producer.get(node.input[0])
        users = g.consumers.get(node.output[0], [])
        if flat is None or flat.op_type != "Reshape" or len(users) != 1 or users[0].op_type != "Reshape":
            continue
        x, back = flat.input[0], users[0]
        x_shape, out_shape = g.shape(x), g.shape(back.output[0])
        if x_shape is None or out_shape is None or len(x_shape) < 3 or len(g.consumers.get(flat.output[0], [])) != 1:
            continue
        weight = g.consts[node.input[1]]
        weight = weight.T if attrs.get("transB", 0) else weight
        if list(out_shape) != [*x_shape[:-1], weight.shape[1]] or x_shape[-1] != weight.shape[0]:
            continue
        bias = g.consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if len(node.input) > 2 and node.input[2] and (bias is None or bias.size != weight.shape[1]):
            continue
        mm, y = g.node("MatMul", [x, g.const(np.ascontiguousarray(weight), "weight")], "linear")
        new = [mm]
        if bias is not None:
            add, y = g.node("Add", [y, g.const(bias.reshape(-1), "bias")], "linear_bias")
            new.append(add)
        g.graph.node.remove(flat)
        g.graph.node.remove(node)
        g.replace(back, new, y)
        g.refresh()
        n += 1
    return n


def rewrite_for_ncnn(model: Any) -> RewriteReport:
    """Rewrite ``model`` (an onnx ModelProto at static input shapes) in place for pnnx; return what changed."""
    report = RewriteReport()
    _drop_stale_value_info(model)
    g = _Graph(model)
    report.add("zero bias on LayerNormalization", _layer_norm_biases(g))
    report.add("flattened Gemm as a batched MatMul", _batched_linears(g))
    g.refresh()
    for node in list(g.graph.node):
        if node.op_type in ("Gather", "GatherND", "GatherElements") and _is_onnx(node):
            done = _rewrite_gather(g, node)
            if done:
                report.add(done)
    g.refresh()
    _rewrite_masks(g, report)
    g.refresh()
    report.add("embedding Gather without axis attribute (pnnx's Embed pattern)", _embedding_gathers(g))
    g.refresh()
    report.add("integer input only cast to float taken as float", _float_inputs(g))
    report.add("strided Slice as reshape + slice", _strided_slices(g))
    report.add("one-axis reduction over two axes (pnnx's list form)", _single_axis_reduces(g))
    report.add("integer power as products", _integer_powers(g))
    g.refresh()
    report.add(f"Transpose of > {NCNN_MAX_AXES} axes merged", _high_rank_transposes(g))
    g.refresh()
    report.add("Reshape chain folded", _reshape_chains(g))
    _drop_stale_value_info(model)
    return report


def _drop_stale_value_info(model: Any) -> None:
    """Forget recorded intermediate types: rewritten values changed type; shape inference records them anew."""
    del model.graph.value_info[:]
