"""Caffe (deploy .prototxt + .caffemodel) to ONNX, layer by layer, from the vetted net.

No Caffe framework or converter package installs alongside Kiln's set (caffe2onnx and
x2paddle carry protobuf-3-era generated code; x2paddle also needs paddlepaddle), so this
module maps Caffe's inference layers onto ONNX operators itself. The mapping follows
Caffe's own forward code where ONNX's defaults differ:

- Pooling rounds its output size up (ceil) and drops a last window that would start in the
  padding; the ONNX node gets that size through explicit end pads. AVE pooling divides by the
  window clipped to the padded input (padding counts, the ceil overhang does not): the input
  is zero-padded first and the pool runs with ``count_include_pad=0``.
- BatchNorm's stored mean and variance are divided by its third blob (the moving-average
  scale factor); Scale and Bias broadcast their blobs from ``axis``.
- InnerProduct flattens from ``axis`` and multiplies by the transposed weight (``transpose``
  off) as Caffe's ``caffe_cpu_gemm`` does.

Blob names become ONNX tensor names; an in-place layer (top == bottom) writes a fresh
name, and each net output keeps its Caffe blob name, as the OpenCV reference runner reports
it. The batch axis is left open ("batch"); other axes keep the deploy net's sizes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from services.artifacts import Artifact
from services.errors import ConversionFailed, KilnError
from services.formats import Format
from services.formats.caffe import CaffeLayer, CaffeNet, load_caffe_net
from services.steps.context import StepContext

__all__ = ["DEFAULT_OPSET", "SUPPORTED_LAYERS", "caffe_net_to_onnx", "caffe_to_onnx"]

DEFAULT_OPSET = 17
MODEL_FILE = "model.onnx"


class _Unsupported(Exception):
    pass


class _Builder:
    """Accumulates ONNX nodes and initializers, tracking each blob's current name and shape."""

    def __init__(self, net: CaffeNet) -> None:
        self.net = net
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.current: dict[str, str] = {}  # caffe blob -> current onnx name
        self.shape: dict[str, list[int]] = {}  # onnx name -> shape (batch as in the deploy net)
        self.used: set[str] = set()
        self._n = 0

    def fresh(self, blob: str) -> str:
        name = blob if blob not in self.used else f"{blob}__{len(self.used)}"
        while name in self.used:
            self._n += 1
            name = f"{blob}__{self._n}"
        self.used.add(name)
        return name

    def const(self, hint: str, arr: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.fresh(hint)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], name: str, **attrs: Any) -> None:
        from onnx import helper

        self.nodes.append(helper.make_node(op, inputs, outputs, name=self.fresh(name + "/" + op), **attrs))

    def bottom(self, layer: CaffeLayer, i: int = 0) -> str:
        blob = layer.bottoms[i]
        if blob not in self.current:
            raise _Unsupported(f"layer {layer.name!r} reads blob {blob!r}, which no earlier layer produces")
        return self.current[blob]

    def top(self, layer: CaffeLayer, shape: list[int], i: int = 0) -> str:
        name = self.fresh(layer.tops[i])
        self.current[layer.tops[i]] = name
        self.shape[name] = shape
        return name


def _pair(values: Any, h: Any, w: Any, default: int, has_hw: bool) -> tuple[int, int]:
    if has_hw:
        return int(h), int(w)
    vals = [int(v) for v in values] if isinstance(values, (list, tuple)) or hasattr(values, "__len__") else [values]
    if not vals:
        return default, default
    return (vals[0], vals[0]) if len(vals) == 1 else (vals[0], vals[1])


def _conv(b: _Builder, layer: CaffeLayer, transpose: bool) -> None:
    p = layer.param.convolution_param
    x = b.bottom(layer)
    if len(b.shape[x]) != 4:
        raise _Unsupported(f"{layer.type} {layer.name!r}: only 2-D (NCHW) inputs are converted")
    n, c, h, w = b.shape[x]
    kh, kw = _pair(list(p.kernel_size), p.kernel_h, p.kernel_w, 1, p.HasField("kernel_h"))
    sh, sw = _pair(list(p.stride), p.stride_h, p.stride_w, 1, p.HasField("stride_h"))
    ph, pw = _pair(list(p.pad), p.pad_h, p.pad_w, 0, p.HasField("pad_h") or p.HasField("pad_w"))
    dil = [int(d) for d in p.dilation] or [1]
    dh, dw = (dil[0], dil[0]) if len(dil) == 1 else (dil[0], dil[1])
    group = int(p.group)
    if not layer.blobs:
        raise _Unsupported(f"{layer.type} {layer.name!r} has no weights in the caffemodel")
    weight = layer.blobs[0]
    m = int(p.num_output)
    if transpose:
        weight = weight.reshape(c, m // group, kh, kw)
        oh = (h - 1) * sh - 2 * ph + dh * (kh - 1) + 1
        ow = (w - 1) * sw - 2 * pw + dw * (kw - 1) + 1
    else:
        weight = weight.reshape(m, c // group, kh, kw)
        oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
        ow = (w + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    inputs = [x, b.const(layer.name + "/weight", weight)]
    if p.bias_term and len(layer.blobs) > 1:
        inputs.append(b.const(layer.name + "/bias", layer.blobs[1].reshape(-1)))
    y = b.top(layer, [n, m, oh, ow])
    b.node(
        "ConvTranspose" if transpose else "Conv",
        inputs,
        [y],
        layer.name,
        kernel_shape=[kh, kw],
        strides=[sh, sw],
        pads=[ph, pw, ph, pw],
        dilations=[dh, dw],
        group=group,
    )


def _pool(b: _Builder, layer: CaffeLayer) -> None:
    p = layer.param.pooling_param
    x = b.bottom(layer)
    if len(b.shape[x]) != 4:
        raise _Unsupported(f"Pooling {layer.name!r}: only 2-D (NCHW) inputs are converted")
    n, c, h, w = b.shape[x]
    method = int(p.pool)
    if method == 2:
        raise _Unsupported(f"Pooling {layer.name!r}: STOCHASTIC pooling has no ONNX counterpart")
    if p.global_pooling:
        y = b.top(layer, [n, c, 1, 1])
        b.node("GlobalMaxPool" if method == 0 else "GlobalAveragePool", [x], [y], layer.name)
        return
    kh, kw = (int(p.kernel_h), int(p.kernel_w)) if p.HasField("kernel_h") else (int(p.kernel_size),) * 2
    sh, sw = (int(p.stride_h), int(p.stride_w)) if p.HasField("stride_h") else (int(p.stride),) * 2
    ph, pw = (int(p.pad_h), int(p.pad_w)) if p.HasField("pad_h") or p.HasField("pad_w") else (int(p.pad),) * 2
    if kh <= 0 or kw <= 0 or sh <= 0 or sw <= 0:
        raise _Unsupported(f"Pooling {layer.name!r}: kernel and stride must be positive")

    def out_size(size: int, k: int, s: int, pad: int) -> int:
        o = math.ceil((size + 2 * pad - k) / s) + 1
        if pad and (o - 1) * s >= size + pad:
            o -= 1  # Caffe: the last window must start inside the image or its left/top padding
        return o

    oh, ow = out_size(h, kh, sh, ph), out_size(w, kw, sw, pw)
    # End pads that make ONNX's floor formula give Caffe's ceil size (the overhang past the padding).
    eh = max((oh - 1) * sh + kh - h - 2 * ph, 0)
    ew = max((ow - 1) * sw + kw - w - 2 * pw, 0)
    y = b.top(layer, [n, c, oh, ow])
    if method == 0:
        b.node(
            "MaxPool", [x], [y], layer.name, kernel_shape=[kh, kw], strides=[sh, sw], pads=[ph, pw, ph + eh, pw + ew]
        )
        return
    src = x
    if ph or pw:
        padded = b.fresh(layer.name + "/padded")
        pads = b.const(layer.name + "/pads", np.array([0, 0, ph, pw, 0, 0, ph, pw], dtype=np.int64))
        b.node("Pad", [x, pads], [padded], layer.name)
        src = padded
    b.node(
        "AveragePool",
        [src],
        [y],
        layer.name,
        kernel_shape=[kh, kw],
        strides=[sh, sw],
        pads=[0, 0, eh, ew],
        count_include_pad=0,
    )


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _inner_product(b: _Builder, layer: CaffeLayer) -> None:
    p = layer.param.inner_product_param
    x = b.bottom(layer)
    shape = b.shape[x]
    axis = _axis(int(p.axis), len(shape))
    k = int(np.prod(shape[axis:]))
    m = int(p.num_output)
    if not layer.blobs:
        raise _Unsupported(f"InnerProduct {layer.name!r} has no weights in the caffemodel")
    weight = layer.blobs[0].reshape((k, m) if p.transpose else (m, k))
    flat = b.fresh(layer.name + "/flat")
    b.node("Flatten", [x], [flat], layer.name, axis=axis)
    inputs = [flat, b.const(layer.name + "/weight", weight)]
    if p.bias_term and len(layer.blobs) > 1:
        inputs.append(b.const(layer.name + "/bias", layer.blobs[1].reshape(-1)))
    out_shape = [*shape[:axis], m]
    if axis == 1:
        y = b.top(layer, out_shape)
        b.node("Gemm", inputs, [y], layer.name, transB=0 if p.transpose else 1)
        return
    gemm = b.fresh(layer.name + "/gemm")
    b.node("Gemm", inputs, [gemm], layer.name, transB=0 if p.transpose else 1)
    # The leading axes come from the input at run time (the batch axis is open).
    lead = b.fresh(layer.name + "/lead")
    b.node("Shape", [x], [lead], layer.name, end=axis)
    target = b.fresh(layer.name + "/target")
    b.node("Concat", [lead, b.const(layer.name + "/m", np.array([m], np.int64))], [target], layer.name, axis=0)
    y = b.top(layer, out_shape)
    b.node("Reshape", [gemm, target], [y], layer.name)


def _broadcast_const(blob: np.ndarray, axis: int, rank: int) -> np.ndarray:
    """Return ``blob`` shaped to broadcast against a rank-``rank`` tensor from ``axis`` on."""
    trailing = rank - axis - blob.ndim
    if trailing < 0:
        raise _Unsupported(f"a blob of shape {list(blob.shape)} does not fit from axis {axis} of a rank-{rank} input")
    return blob.reshape(list(blob.shape) + [1] * trailing)


def _scale_or_bias(b: _Builder, layer: CaffeLayer) -> None:
    x = b.bottom(layer)
    rank = len(b.shape[x])
    is_scale = layer.type == "Scale"
    p = layer.param.scale_param if is_scale else layer.param.bias_param
    axis = _axis(int(p.axis), rank)
    if len(layer.bottoms) > 1:
        other = b.bottom(layer, 1)
        k = len(b.shape[other])
        trailing = rank - axis - k
        if trailing > 0:
            unsq = b.fresh(layer.name + "/unsqueezed")
            axes = b.const(layer.name + "/axes", np.arange(axis + k, rank, dtype=np.int64))
            b.node("Unsqueeze", [other, axes], [unsq], layer.name)
            other = unsq
        first = other
        blobs = layer.blobs
    else:
        if not layer.blobs:
            raise _Unsupported(f"{layer.type} {layer.name!r} has no weights in the caffemodel")
        first = b.const(layer.name + ("/scale" if is_scale else "/bias"), _broadcast_const(layer.blobs[0], axis, rank))
        blobs = layer.blobs[1:]
    y_shape = b.shape[x]
    if is_scale and layer.param.scale_param.bias_term and blobs:
        mid = b.fresh(layer.name + "/scaled")
        b.node("Mul", [x, first], [mid], layer.name)
        bias = b.const(layer.name + "/bias", _broadcast_const(blobs[-1], axis, rank))
        y = b.top(layer, y_shape)
        b.node("Add", [mid, bias], [y], layer.name)
        return
    y = b.top(layer, y_shape)
    b.node("Mul" if is_scale else "Add", [x, first], [y], layer.name)


def _batch_norm(b: _Builder, layer: CaffeLayer) -> None:
    p = layer.param.batch_norm_param
    x = b.bottom(layer)
    if len(layer.blobs) < 3:
        raise _Unsupported(f"BatchNorm {layer.name!r} needs its mean, variance and scale-factor blobs")
    factor = float(layer.blobs[2].reshape(-1)[0])
    factor = 0.0 if factor == 0 else 1.0 / factor
    mean = layer.blobs[0].reshape(-1) * factor
    var = layer.blobs[1].reshape(-1) * factor
    c = mean.shape[0]
    y = b.top(layer, b.shape[x])
    b.node(
        "BatchNormalization",
        [
            x,
            b.const(layer.name + "/gamma", np.ones(c, np.float32)),
            b.const(layer.name + "/beta", np.zeros(c, np.float32)),
            b.const(layer.name + "/mean", mean.astype(np.float32)),
            b.const(layer.name + "/var", var.astype(np.float32)),
        ],
        [y],
        layer.name,
        epsilon=float(p.eps),
    )


def _eltwise(b: _Builder, layer: CaffeLayer) -> None:
    p = layer.param.eltwise_param
    xs = [b.bottom(layer, i) for i in range(len(layer.bottoms))]
    shape = b.shape[xs[0]]
    op = int(p.operation)
    coeff = list(p.coeff)
    if op == 1 and coeff and any(cf != 1.0 for cf in coeff):
        scaled = []
        for i, (x, cf) in enumerate(zip(xs, coeff, strict=True)):
            s = b.fresh(f"{layer.name}/coeff{i}")
            b.node("Mul", [x, b.const(f"{layer.name}/c{i}", np.array(cf, np.float32))], [s], layer.name)
            scaled.append(s)
        xs = scaled
    if op == 0:  # PROD: ONNX Mul is binary
        acc = xs[0]
        for i, other in enumerate(xs[1:]):
            nxt = b.top(layer, shape) if i == len(xs) - 2 else b.fresh(f"{layer.name}/prod{i}")
            b.node("Mul", [acc, other], [nxt], layer.name)
            acc = nxt
        return
    y = b.top(layer, shape)
    b.node("Sum" if op == 1 else "Max", xs, [y], layer.name)


def _activation(b: _Builder, layer: CaffeLayer) -> None:
    x = b.bottom(layer)
    shape = b.shape[x]
    t = layer.type
    if t == "ReLU":
        slope = float(layer.param.relu_param.negative_slope)
        y = b.top(layer, shape)
        if slope:
            b.node("LeakyRelu", [x], [y], layer.name, alpha=slope)
        else:
            b.node("Relu", [x], [y], layer.name)
    elif t == "PReLU":
        slopes = layer.blobs[0].reshape(-1)
        y = b.top(layer, shape)
        slope_c = slopes.reshape([1] * (len(shape) - 1) if slopes.size == 1 else [slopes.size] + [1] * (len(shape) - 2))
        b.node("PRelu", [x, b.const(layer.name + "/slope", slope_c)], [y], layer.name)
    elif t == "ELU":
        y = b.top(layer, shape)
        b.node("Elu", [x], [y], layer.name, alpha=float(layer.param.elu_param.alpha))
    elif t == "Power":
        p = layer.param.power_param
        cur = x
        if p.scale != 1.0:
            nxt = b.fresh(layer.name + "/scaled")
            b.node("Mul", [cur, b.const(layer.name + "/scale", np.array(p.scale, np.float32))], [nxt], layer.name)
            cur = nxt
        if p.shift != 0.0:
            nxt = b.fresh(layer.name + "/shifted")
            b.node("Add", [cur, b.const(layer.name + "/shift", np.array(p.shift, np.float32))], [nxt], layer.name)
            cur = nxt
        y = b.top(layer, shape)
        if p.power != 1.0:
            b.node("Pow", [cur, b.const(layer.name + "/power", np.array(p.power, np.float32))], [y], layer.name)
        else:
            b.node("Identity", [cur], [y], layer.name)
    else:
        y = b.top(layer, shape)
        op = {"Sigmoid": "Sigmoid", "TanH": "Tanh", "AbsVal": "Abs", "Dropout": "Identity", "Exp": "Exp"}[t]
        b.node(op, [x], [y], layer.name)


def _softmax(b: _Builder, layer: CaffeLayer) -> None:
    x = b.bottom(layer)
    y = b.top(layer, b.shape[x])
    b.node("Softmax", [x], [y], layer.name, axis=int(layer.param.softmax_param.axis))


def _lrn(b: _Builder, layer: CaffeLayer) -> None:
    p = layer.param.lrn_param
    if int(p.norm_region) != 0:
        raise _Unsupported(f"LRN {layer.name!r}: WITHIN_CHANNEL normalisation is not converted")
    x = b.bottom(layer)
    y = b.top(layer, b.shape[x])
    b.node(
        "LRN", [x], [y], layer.name, size=int(p.local_size), alpha=float(p.alpha), beta=float(p.beta), bias=float(p.k)
    )


def _concat(b: _Builder, layer: CaffeLayer) -> None:
    p = layer.param.concat_param
    xs = [b.bottom(layer, i) for i in range(len(layer.bottoms))]
    rank = len(b.shape[xs[0]])
    axis = _axis(int(p.axis) if p.HasField("axis") or not p.HasField("concat_dim") else int(p.concat_dim), rank)
    shape = list(b.shape[xs[0]])
    shape[axis] = sum(b.shape[x][axis] for x in xs)
    y = b.top(layer, shape)
    b.node("Concat", xs, [y], layer.name, axis=axis)


def _flatten(b: _Builder, layer: CaffeLayer) -> None:
    p = layer.param.flatten_param
    x = b.bottom(layer)
    shape = b.shape[x]
    axis, end = _axis(int(p.axis), len(shape)), _axis(int(p.end_axis), len(shape))
    out = [*shape[:axis], int(np.prod(shape[axis : end + 1])), *shape[end + 1 :]]
    y = b.top(layer, out)
    if axis == 1 and end == len(shape) - 1:
        b.node("Flatten", [x], [y], layer.name, axis=1)
        return
    target = b.const(layer.name + "/shape", np.array([0, *out[1:]], np.int64))
    b.node("Reshape", [x, target], [y], layer.name)


def _reshape(b: _Builder, layer: CaffeLayer) -> None:
    p = layer.param.reshape_param
    x = b.bottom(layer)
    shape = b.shape[x]
    dims = [int(d) for d in p.shape.dim]
    if int(p.axis) != 0 or int(p.num_axes) != -1:
        axis = _axis(int(p.axis), len(shape) + 1) if int(p.axis) < 0 else int(p.axis)
        end = len(shape) if int(p.num_axes) == -1 else axis + int(p.num_axes)
        dims = [*shape[:axis], *dims, *shape[end:]]
        dims = [0 if i == 0 else d for i, d in enumerate(dims)]
    out = [shape[i] if d == 0 else d for i, d in enumerate(dims)]
    if -1 in out:
        known = int(np.prod([d for d in out if d != -1]))
        out[out.index(-1)] = int(np.prod(shape)) // max(known, 1)
    y = b.top(layer, out)
    b.node("Reshape", [x, b.const(layer.name + "/shape", np.array(dims, np.int64))], [y], layer.name)


def _slice(b: _Builder, layer: CaffeLayer) -> None:
    p = layer.param.slice_param
    x = b.bottom(layer)
    shape = b.shape[x]
    axis = _axis(int(p.axis) if p.HasField("axis") or not p.HasField("slice_dim") else int(p.slice_dim), len(shape))
    total = shape[axis]
    points = [int(s) for s in p.slice_point]
    if points:
        bounds = [0, *points, total]
        sizes = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
    else:
        sizes = [total // len(layer.tops)] * len(layer.tops)
    outs = []
    for i, size in enumerate(sizes):
        s = list(shape)
        s[axis] = size
        outs.append(b.top(layer, s, i))
    b.node("Split", [x, b.const(layer.name + "/split", np.array(sizes, np.int64))], outs, layer.name, axis=axis)


def _split(b: _Builder, layer: CaffeLayer) -> None:
    x = b.bottom(layer)
    for i in range(len(layer.tops)):
        y = b.top(layer, b.shape[x], i)
        b.node("Identity", [x], [y], layer.name)


_LAYERS: dict[str, Any] = {
    "Convolution": lambda b, layer: _conv(b, layer, transpose=False),
    "Deconvolution": lambda b, layer: _conv(b, layer, transpose=True),
    "Pooling": _pool,
    "InnerProduct": _inner_product,
    "BatchNorm": _batch_norm,
    "Scale": _scale_or_bias,
    "Bias": _scale_or_bias,
    "Eltwise": _eltwise,
    "ReLU": _activation,
    "PReLU": _activation,
    "ELU": _activation,
    "Sigmoid": _activation,
    "TanH": _activation,
    "AbsVal": _activation,
    "Exp": _activation,
    "Power": _activation,
    "Dropout": _activation,
    "Softmax": _softmax,
    "LRN": _lrn,
    "Concat": _concat,
    "Flatten": _flatten,
    "Reshape": _reshape,
    "Slice": _slice,
    "Split": _split,
}
SUPPORTED_LAYERS = frozenset(_LAYERS)


def caffe_net_to_onnx(net: CaffeNet, opset: int = DEFAULT_OPSET) -> Any:
    """Return the ONNX ModelProto of ``net``; ``ValueError`` names the first layer it cannot convert."""
    from onnx import TensorProto, helper

    unsupported = sorted({layer.type for layer in net.layers} - SUPPORTED_LAYERS)
    if unsupported:
        raise ValueError(f"layer types without an ONNX mapping here: {', '.join(unsupported)}")
    b = _Builder(net)
    graph_inputs = []
    for name, shape in net.inputs.items():
        b.used.add(name)
        b.current[name] = name
        b.shape[name] = list(shape)
        graph_inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", *shape[1:]]))
    for layer in net.layers:
        try:
            _LAYERS[layer.type](b, layer)
        except _Unsupported as exc:
            raise ValueError(str(exc)) from None
        except (ValueError, IndexError, KeyError) as exc:
            raise ValueError(f"{layer.type} layer {layer.name!r}: {exc}") from exc
    graph_outputs = []
    for blob in net.outputs:
        name = b.current[blob]
        if name != blob:
            # The blob's first name belongs to an earlier (in-place) producer; rename that one
            # so the graph output carries the Caffe blob name.
            tmp = b.fresh(blob + "__orig")
            for node in b.nodes:
                node.input[:] = [tmp if i == blob else i for i in node.input]
                node.output[:] = [tmp if o == blob else o for o in node.output]
            for node in b.nodes:
                node.input[:] = [blob if i == name else i for i in node.input]
                node.output[:] = [blob if o == name else o for o in node.output]
            b.shape[blob] = b.shape[name]
            name = blob
        shape = b.shape[name]
        graph_outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", *shape[1:]]))
    graph = helper.make_graph(b.nodes, net.name or "caffe", graph_inputs, graph_outputs, initializer=b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="kiln caffe_to_onnx")
    model.ir_version = min(model.ir_version, 10)
    return model


def caffe_to_onnx(ctx: StepContext) -> Artifact:
    """Convert the Caffe source (deploy prototxt + caffemodel) to model.onnx."""
    import onnx

    opset = ctx.opset(DEFAULT_OPSET)
    net = load_caffe_net(ctx.model.path)
    ctx.progress(f"converting Caffe net {net.name!r} ({len(net.layers)} layers) to ONNX opset {opset}")
    try:
        model = caffe_net_to_onnx(net, opset)
        onnx.checker.check_model(model, full_check=True)
    except KilnError:
        raise
    except Exception as exc:
        raise ConversionFailed(
            f"caffe_to_onnx could not convert {net.prototxt.name}: {exc}",
            hint="Kiln converts Caffe's inference layers: " + ", ".join(sorted(SUPPORTED_LAYERS)) + ".",
            step=ctx.step.id,
            tool="kiln caffe_to_onnx",
        ) from exc
    dst = ctx.out_dir / MODEL_FILE
    onnx.save(model, str(dst))
    return Artifact(
        root=ctx.out_dir,
        kind=Format.ONNX.value,
        entry=MODEL_FILE,
        meta={
            "exporter": "kiln caffe_to_onnx",
            "opset": opset,
            "layers": len(net.layers),
            "io": {
                "inputs": [{"name": k, "dtype": "float32", "shape": [None, *v[1:]]} for k, v in net.inputs.items()],
                "outputs": net.outputs,
            },
        },
    )
