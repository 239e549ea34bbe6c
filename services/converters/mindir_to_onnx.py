"""MindIR to ONNX: MindSpore's own exporter first, Kiln's protobuf converter as the fallback route.

:func:`mindir_to_onnx_mindspore` loads the MindIR as an ``nn.GraphCell`` and hands it to
``mindspore.onnx.export``. That works only on a cell that has not run yet: exporting a
GraphCell after calling it fails in MindSpore 2.10.0 with ``RuntimeError: The
pointer[context] is null`` (``program_specialize.cc:389 GetFuncGraphSpecializer``), so the
step loads a fresh cell of its own and never runs it (the reference step runs another).

:func:`mindir_to_onnx` reads the compiled graph (``mind_ir_pb2``) and maps its primitives
onto ONNX operators itself: the inference ops of CNNs and MLPs (Conv2D, BatchNorm, pooling,
MatMul, BiasAdd, element-wise arithmetic, activations, Concat, Flatten, Reshape, Softmax,
Transpose). Control-flow graphs (``functions``), and any other primitive, are refused with
CONVERSION_FAILED naming it. It is the planner's second route when MindSpore's exporter
fails. Parity against ``nn.GraphCell`` checks either.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.artifacts import Artifact
from services.errors import ConversionFailed, KilnError
from services.formats import Format
from services.formats.mindir import vet_mindir
from services.runners.mindir import DTYPES, mindir_signature, public_name
from services.steps.context import StepContext

__all__ = ["SUPPORTED_PRIMITIVES", "mindir_model_to_onnx", "mindir_to_onnx", "mindir_to_onnx_mindspore"]

DEFAULT_OPSET = 17
MODEL_FILE = "model.onnx"

_CONTROL = {"Load", "Depend", "UpdateState", "TupleGetItem", "MakeTuple", "Return"}
_UNARY = {
    "ReLU": "Relu",
    "Sigmoid": "Sigmoid",
    "Tanh": "Tanh",
    "Exp": "Exp",
    "Sqrt": "Sqrt",
    "Abs": "Abs",
    "Neg": "Neg",
    "Erf": "Erf",
}
_BINARY = {"Add": "Add", "Sub": "Sub", "Mul": "Mul", "RealDiv": "Div", "Div": "Div", "Maximum": "Max", "Minimum": "Min"}
SUPPORTED_PRIMITIVES = frozenset(
    _CONTROL
    | set(_UNARY)
    | set(_BINARY)
    | {"Conv2D", "BiasAdd", "BatchNorm", "MaxPool", "AvgPool", "MatMul", "Flatten", "Concat"}
    | {"Reshape", "Softmax", "Transpose", "ReLU6", "GeLU", "HSwish"}
)


def _value(attr: Any) -> Any:
    """Return an AttributeProto's value as Python (ints, floats, strings, tuples, numpy arrays)."""
    t = attr.type
    if t in (23, 24, 25):  # UMONAD, IOMONAD, NONE
        return None
    if t in (2, 3, 4, 5, 6, 7, 12, 13):
        return int(attr.ints[0]) if len(attr.ints) else int(attr.i)
    if t == 9:
        return bool(attr.ints[0]) if len(attr.ints) else bool(attr.i)
    if t in (1, 11, 10):
        if len(attr.floats):
            return float(attr.floats[0])
        if len(attr.doubles):
            return float(attr.doubles[0])
        return float(attr.f if t != 11 else attr.d)
    if t == 8:
        s = attr.strings[0] if len(attr.strings) else attr.s
        return s.decode() if isinstance(s, bytes) else s
    if t in (20, 21):
        return tuple(_value(v) for v in attr.values)
    if t == 17:
        return _tensor(attr.t)
    if t == 19 and len(attr.tensors) == 1:
        return _tensor(attr.tensors[0])
    raise ValueError(f"attribute {attr.name!r} has a type Kiln does not read ({t})")


def _tensor(t: Any) -> np.ndarray:
    dtype = np.dtype(DTYPES.get(t.data_type, "float32"))
    dims = [int(d) for d in t.dims]
    if t.raw_data:
        arr = np.frombuffer(t.raw_data, dtype=dtype)
    elif len(t.float_data):
        arr = np.asarray(t.float_data, dtype=dtype)
    elif len(t.int64_data):
        arr = np.asarray(t.int64_data, dtype=dtype)
    elif len(t.int32_data):
        arr = np.asarray(t.int32_data, dtype=dtype)
    else:
        arr = np.zeros(0, dtype=dtype)
    count = int(np.prod(dims)) if dims else 1
    if arr.size != count:
        raise ValueError(f"tensor {t.name!r} declares {dims} but holds {arr.size} values")
    return arr.reshape(dims).copy()


def _pair(v: Any) -> list[int]:
    """Return (h, w) from MindSpore's int, 2-tuple or NCHW 4-tuple."""
    if isinstance(v, int):
        return [v, v]
    v = [int(x) for x in v]
    return v[-2:] if len(v) >= 2 else [v[0], v[0]]


class _Graph:
    def __init__(self, model: Any, opset: int) -> None:
        from onnx import numpy_helper

        self.numpy_helper = numpy_helper
        self.model = model
        self.opset = opset
        self.prims = {p.name: p for p in model.primitives}
        self.values: dict[str, Any] = {}  # mindir name -> ("onnx", name) | ("const", value) | ("tuple", [...])
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.shapes: dict[str, list[int]] = {}  # onnx initializer name -> shape
        self.param_arrays: dict[str, np.ndarray] = {}  # onnx initializer name -> weights
        self.n = 0

    def fresh(self, hint: str) -> str:
        self.n += 1
        return f"{public_name(hint)}_{self.n}"

    def init(self, arr: np.ndarray, hint: str) -> str:
        name = self.fresh(hint)
        self.inits.append(self.numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def onnx_input(self, ref: str) -> str:
        kind, v = self.values[ref]
        if kind == "onnx":
            return str(v)
        if kind == "const" and isinstance(v, (np.ndarray, int, float)):
            return self.init(np.asarray(v, dtype=np.float32 if isinstance(v, float) else None), "const")
        raise ValueError(f"{ref!r} is not a tensor")

    def const(self, ref: str) -> Any:
        kind, v = self.values[ref]
        if kind != "const":
            raise ValueError(f"{ref!r} is computed at run time; Kiln needs it constant here")
        return v

    def const_or_param(self, ref: str) -> Any:
        kind, v = self.values[ref]
        if kind == "const":
            return v
        if kind == "onnx" and v in self.param_arrays:
            return self.param_arrays[v]
        raise ValueError(f"{ref!r} must be a constant or a weight")

    def emit(self, op: str, inputs: list[str], hint: str, **attrs: Any) -> str:
        from onnx import helper

        out = self.fresh(hint)
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out


def _prim(g: _Graph, node: Any) -> tuple[str, dict[str, Any]]:
    ref = node.op_type.removeprefix("REF::")
    prim = g.prims.get(ref)
    op = prim.op_type if prim is not None else ref.split(":")[0]
    attrs = {a.name: _value(a) for a in prim.attribute if a.name not in ("input_names", "output_names")} if prim else {}
    return op, attrs


def _rank(node: Any) -> int | None:
    for a in node.attribute:
        if a.name == "shape" and len(a.tensors) == 1:
            return len(a.tensors[0].dims)
    return None


def _convert_node(g: _Graph, node: Any) -> None:
    op, attrs = _prim(g, node)
    ins = list(node.input)
    out = node.output[0]
    if op == "Load" or op == "Depend":
        g.values[out] = g.values[ins[0]]
        return
    if op == "UpdateState":
        g.values[out] = ("const", None)
        return
    if op == "MakeTuple":
        g.values[out] = ("tuple", ins)
        return
    if op == "TupleGetItem":
        kind, v = g.values[ins[0]]
        index = int(g.const(ins[1]))
        g.values[out] = g.values[v[index]] if kind == "tuple" else (kind, v) if index == 0 else ("const", None)
        return
    if op in _UNARY:
        g.values[out] = ("onnx", g.emit(_UNARY[op], [g.onnx_input(ins[0])], out))
        return
    if op in _BINARY:
        g.values[out] = ("onnx", g.emit(_BINARY[op], [g.onnx_input(ins[0]), g.onnx_input(ins[1])], out))
        return
    if op == "ReLU6":
        lo, hi = g.init(np.array(0, np.float32), "lo"), g.init(np.array(6, np.float32), "hi")
        g.values[out] = ("onnx", g.emit("Clip", [g.onnx_input(ins[0]), lo, hi], out))
        return
    if op == "HSwish":
        g.values[out] = ("onnx", g.emit("HardSwish", [g.onnx_input(ins[0])], out))
        return
    if op == "GeLU":
        x = g.onnx_input(ins[0])
        erf_in = g.emit("Mul", [x, g.init(np.array(1 / np.sqrt(2), np.float32), "rsqrt2")], out)
        one_plus = g.emit("Add", [g.emit("Erf", [erf_in], out), g.init(np.array(1, np.float32), "one")], out)
        half_x = g.emit("Mul", [x, g.init(np.array(0.5, np.float32), "half")], out)
        g.values[out] = ("onnx", g.emit("Mul", [half_x, one_plus], out))
        return
    if op == "Conv2D":
        x, w = g.onnx_input(ins[0]), g.onnx_input(ins[1])
        kernel = [int(d) for d in g.shapes[w][-2:]] if w in g.shapes else None
        pad_mode = str(attrs.get("pad_mode", "valid")).lower()
        kw: dict[str, Any] = {
            "strides": _pair(attrs.get("stride", 1)),
            "dilations": _pair(attrs.get("dilation", 1)),
            "group": int(attrs.get("group", attrs.get("groups", 1))),
        }
        if kernel:
            kw["kernel_shape"] = kernel
        if pad_mode == "same":
            kw["auto_pad"] = "SAME_UPPER"
        elif pad_mode == "pad":
            top, bottom, left, right = [int(p) for p in attrs.get("pad_list") or attrs.get("pad", (0, 0, 0, 0))]
            kw["pads"] = [top, left, bottom, right]
        g.values[out] = ("onnx", g.emit("Conv", [x, w], out, **kw))
        return
    if op == "BiasAdd":
        x = g.onnx_input(ins[0])
        bias = np.asarray(g.const_or_param(ins[1]), np.float32)
        rank = _rank(node) or 4
        b = g.init(bias.reshape([bias.size] + [1] * (rank - 2)) if rank > 2 else bias, "bias")
        g.values[out] = ("onnx", g.emit("Add", [x, b], out))
        return
    if op == "BatchNorm":
        if g.const(ins[5]):
            raise ValueError("BatchNorm is in training mode (is_training=True); export after net.set_train(False)")
        x = g.onnx_input(ins[0])
        params = [g.onnx_input(r) for r in ins[1:5]]
        eps = float(g.const(ins[6]))
        g.values[out] = ("onnx", g.emit("BatchNormalization", [x, *params], out, epsilon=eps))
        return
    if op in ("MaxPool", "AvgPool"):
        x = g.onnx_input(ins[0])
        if len(ins) >= 4:  # PrimFunc form: kernel, strides, pad_mode (0 PAD, 1 SAME, 2 VALID), format
            kernel, strides, mode = g.const(ins[1]), g.const(ins[2]), g.const(ins[3])
            pad_mode = {0: "pad", 1: "same", 2: "valid"}.get(mode, str(mode)) if isinstance(mode, int) else str(mode)
        else:
            kernel, strides = attrs.get("kernel_size", 1), attrs.get("strides", 1)
            pad_mode = str(attrs.get("pad_mode", "valid"))
        pad_mode = pad_mode.lower()
        if pad_mode not in ("same", "valid"):
            raise ValueError(f"{op} with pad_mode {pad_mode!r}")
        kw = {"kernel_shape": _pair(kernel), "strides": _pair(strides)}
        if pad_mode == "same":
            kw["auto_pad"] = "SAME_UPPER"
        onnx_op = "MaxPool" if op == "MaxPool" else "AveragePool"
        g.values[out] = ("onnx", g.emit(onnx_op, [x], out, **kw))
        return
    if op == "MatMul":
        a = g.onnx_input(ins[0])
        ta = bool(g.const(ins[2])) if len(ins) > 2 else bool(attrs.get("transpose_a", False))
        tb = bool(g.const(ins[3])) if len(ins) > 3 else bool(attrs.get("transpose_b", False))
        if ta:
            a = g.emit("Transpose", [a], out, perm=[1, 0])
        b = g.onnx_input(ins[1])
        if tb:
            b = g.emit("Transpose", [b], out, perm=[1, 0])
        g.values[out] = ("onnx", g.emit("MatMul", [a, b], out))
        return
    if op == "Flatten":
        g.values[out] = ("onnx", g.emit("Flatten", [g.onnx_input(ins[0])], out, axis=1))
        return
    if op == "Concat":
        kind, members = g.values[ins[0]]
        if kind != "tuple":
            raise ValueError("Concat of a value that is not a tuple")
        axis = int(g.const(ins[1])) if len(ins) > 1 else int(attrs.get("axis", 0))
        g.values[out] = ("onnx", g.emit("Concat", [g.onnx_input(m) for m in members], out, axis=axis))
        return
    if op == "Reshape":
        shape = np.asarray(g.const(ins[1]), np.int64).reshape(-1)
        g.values[out] = ("onnx", g.emit("Reshape", [g.onnx_input(ins[0]), g.init(shape, "shape")], out))
        return
    if op == "Transpose":
        perm = [int(p) for p in g.const(ins[1])]
        g.values[out] = ("onnx", g.emit("Transpose", [g.onnx_input(ins[0])], out, perm=perm))
        return
    if op == "Softmax":
        axis = g.const(ins[1]) if len(ins) > 1 else attrs.get("axis", -1)
        axis = int(axis[0] if isinstance(axis, tuple) else axis)
        g.values[out] = ("onnx", g.emit("Softmax", [g.onnx_input(ins[0])], out, axis=axis))
        return
    raise ValueError(f"MindIR primitive {op!r} has no ONNX mapping here")


def mindir_model_to_onnx(model: Any, opset: int = DEFAULT_OPSET) -> Any:
    """Return the ONNX ModelProto of a parsed (vetted) MindIR ModelProto; ValueError names what it cannot map."""
    from onnx import helper

    if len(model.functions):
        raise ValueError(f"the graph calls {len(model.functions)} sub-graphs (control flow); Kiln converts flat graphs")
    g = _Graph(model, opset)
    graph = model.graph
    inputs, outputs = mindir_signature(model)
    onnx_inputs = []
    for vi, spec in zip(graph.input, inputs, strict=True):
        g.values[vi.name] = ("onnx", spec.name)
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(spec.dtype))
        onnx_inputs.append(helper.make_tensor_value_info(spec.name, elem, list(spec.shape)))
    for p in graph.parameter:
        arr = _tensor(p)
        name = g.init(arr, p.name)
        g.values[p.name] = ("onnx", name)
        g.shapes[name] = list(arr.shape)
        g.param_arrays[name] = arr
    for node in graph.node:
        if node.op_type == "Constant":
            g.values[node.output[0]] = ("const", _value(node.attribute[0]))
            continue
        try:
            _convert_node(g, node)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            op = _prim(g, node)[0]
            raise ValueError(f"{op} node {node.name or node.output[0]!r}: {exc}") from exc
    # Outputs: the graph's output values (a tuple output yields one per member), renamed output_i.
    produced: list[str] = []
    for vi in graph.output:
        kind, v = g.values[vi.name]
        members = [g.values[m] for m in v] if kind == "tuple" else [(kind, v)]
        for mk, mv in members:
            if mk != "onnx":
                raise ValueError(f"graph output {vi.name!r} is not a tensor")
            produced.append(str(mv))
    onnx_outputs = []
    for spec, name in zip(outputs, produced, strict=True):
        g.nodes.append(helper.make_node("Identity", [name], [spec.name], name=spec.name))
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(spec.dtype))
        onnx_outputs.append(helper.make_tensor_value_info(spec.name, elem, list(spec.shape)))
    used = {i for n in g.nodes for i in n.input}
    inits = [t for t in g.inits if t.name in used]  # weights folded into a reshaped copy (BiasAdd) drop out
    onnx_graph = helper.make_graph(g.nodes, "mindir", onnx_inputs, onnx_outputs, initializer=inits)
    model_out = helper.make_model(onnx_graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="kiln")
    model_out.ir_version = min(model_out.ir_version, 10)
    return model_out


def mindir_to_onnx(ctx: StepContext) -> Artifact:
    """Convert the vetted MindIR source to model.onnx."""
    import onnx

    opset = ctx.opset(DEFAULT_OPSET)
    model = vet_mindir(ctx.model.path)
    ctx.progress(f"converting MindIR ({len(model.graph.node)} nodes) to ONNX opset {opset}")
    try:
        converted = mindir_model_to_onnx(model, opset)
        onnx.checker.check_model(converted, full_check=True)
    except KilnError:
        raise
    except Exception as exc:
        raise ConversionFailed(
            f"mindir_to_onnx could not convert {ctx.model.path.name}: {exc}",
            hint="Kiln maps these MindIR primitives: " + ", ".join(sorted(SUPPORTED_PRIMITIVES - _CONTROL)) + ".",
            step=ctx.step.id,
            tool="kiln mindir_to_onnx",
        ) from exc
    onnx.save(converted, str(ctx.out_dir / MODEL_FILE))
    return Artifact(
        root=ctx.out_dir,
        kind=Format.ONNX.value,
        entry=MODEL_FILE,
        meta={"exporter": "kiln mindir_to_onnx", "opset": opset, "mindspore_producer": model.producer_name},
    )


def mindir_to_onnx_mindspore(ctx: StepContext) -> Artifact:
    """Convert the vetted MindIR source to model.onnx with ``mindspore.onnx.export`` on a fresh GraphCell."""
    import contextlib
    import io

    import onnx

    model = vet_mindir(ctx.model.path)
    inputs, outputs = mindir_signature(model)
    dst = ctx.out_dir / MODEL_FILE
    ctx.progress(f"exporting MindIR to ONNX with mindspore.onnx.export ({len(model.graph.node)} nodes)")
    log = io.StringIO()
    try:
        import mindspore as ms
        import mindspore.onnx
        from mindspore import nn

        ms.set_context(mode=ms.GRAPH_MODE)
        cell = nn.GraphCell(ms.load(str(ctx.model.path)))  # never called: a cell that ran cannot be exported
        example = [ms.Tensor(np.zeros([d or 1 for d in t.shape], dtype=t.dtype)) for t in inputs]
        with contextlib.redirect_stdout(log):
            mindspore.onnx.export(
                cell,
                *example,
                file_name=str(dst),
                input_names=[t.name for t in inputs],
                output_names=[t.name for t in outputs],
            )
        onnx.checker.check_model(str(dst), full_check=True)
    except KilnError:
        raise
    except Exception as exc:
        raise ConversionFailed(
            f"mindspore.onnx.export could not convert {ctx.model.path.name}: {str(exc).strip()[:500]}",
            hint="Kiln's own MindIR converter is the fallback route; the job's attempts show whether it ran.",
            step=ctx.step.id,
            tool="mindspore.onnx.export",
            output_tail=(log.getvalue() + str(exc))[-2000:],
        ) from exc
    return Artifact(
        root=ctx.out_dir,
        kind=Format.ONNX.value,
        entry=MODEL_FILE,
        meta={"exporter": "mindspore.onnx.export", "mindspore_producer": model.producer_name},
    )
