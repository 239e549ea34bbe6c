"""Per-node restrictions of TensorRT's ONNX parser that can be checked without TensorRT.

Each check reads one node (its attributes, which inputs are build-time constants, the dtypes
and ranks shape inference found) and returns the problems it sees, worded after the
Restrictions column of onnx-tensorrt's operator matrix (see :mod:`services.tensorrt.onnx_support`).
Checks only report what they can prove from the file: an input that is not a constant here
may still fold to one inside TensorRT, so "must be a build-time constant" is only reported
for inputs that are plainly computed at run time (graph inputs and outputs of other nodes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import onnx
from onnx import helper

from services.tensorrt.onnx_support import ParserSupport

__all__ = ["CHECKS", "GraphFacts", "node_problems"]


class GraphFacts(Protocol):
    """What a check may ask about the tensors around a node."""

    def constant(self, name: str) -> np.ndarray | None:
        """Return the value of an initializer or Constant output, else None."""

    def dtype(self, name: str) -> str | None:
        """Return the TensorProto.DataType name of a tensor, when known."""

    def rank(self, name: str) -> int | None:
        """Return the rank of a tensor, when known."""


Check = Callable[[onnx.NodeProto, GraphFacts, ParserSupport], list[str]]


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _input(node: onnx.NodeProto, i: int) -> str:
    """Return the i-th input name, or "" when it is absent (omitted optional inputs are "")."""
    return node.input[i] if len(node.input) > i else ""


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _must_be_constant(node: onnx.NodeProto, facts: GraphFacts, index: int, what: str) -> list[str]:
    name = _input(node, index)
    if name and facts.constant(name) is None:
        return [f"`{what}` must be a build-time constant (an initializer), but it is computed at run time"]
    return []


def _pool(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    out = []
    dilations = _attr(node, "dilations")
    if dilations and any(d != 1 for d in dilations):
        out.append(f"dilations must be empty or all ones, got {list(dilations)}")
    kernel = _attr(node, "kernel_shape")
    if node.op_type in ("AveragePool", "MaxPool") and kernel is not None and len(kernel) not in (2, 3):
        out.append(f"2D or 3D pooling only, this is {len(kernel)}D")
    if node.op_type == "MaxPool" and _count_named(node.output) > 1:
        out.append("the `Indices` output is unsupported")
    return out


def _count_named(names: Any) -> int:
    """Return how many of a node's input/output slots are used (omitted ones are "")."""
    return sum(1 for n in names if n)


def _zero_point(node: onnx.NodeProto, facts: GraphFacts, index: int, what: str) -> list[str]:
    name = _input(node, index)
    if not name:
        return []
    value = facts.constant(name)
    if value is None:
        return [f"`{what}` must be an initializer (TensorRT needs it at build time)"]
    if np.any(value != 0):
        return [f"`{what}` must be zero (symmetric quantization), got values up to {int(np.abs(value).max())}"]
    return []


def _quantized_type(dtype: str | None, support: ParserSupport, verb: str) -> list[str]:
    if dtype is None or dtype in support.quantized_types:
        return []
    allowed = ", ".join(sorted(support.quantized_types))
    why = " (an INT32 input is a quantized bias: keep biases in float)" if dtype == "INT32" else ""
    return [f"{verb} {dtype} is not supported; TensorRT's quantized types are {allowed}{why}"]


def _quantize(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    # The output type is the zero point's type, else `output_dtype` (opset 21+). With neither,
    # ONNX means UINT8 but the matrix does not say how the parser reads that, so it is not judged.
    zp = _input(node, 2)
    out_type = facts.dtype(zp) if zp else None
    declared = _attr(node, "output_dtype", 0)
    if out_type is None and declared:
        out_type = onnx.TensorProto.DataType.Name(declared)
    return _zero_point(node, facts, 2, "y_zero_point") + _quantized_type(out_type, support, "quantizing to")


def _dequantize(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    x_type = facts.dtype(_input(node, 0)) or (facts.dtype(_input(node, 2)) if _input(node, 2) else None)
    return _zero_point(node, facts, 2, "x_zero_point") + _quantized_type(x_type, support, "dequantizing")


def _dropout(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    name = _input(node, 2)
    if not name:
        return []
    value = facts.constant(name)
    if value is None:
        return ["`is_training` must be an initializer that evaluates to False"]
    if bool(np.asarray(value).reshape(-1)[0]):
        return ["`is_training` must evaluate to False (TensorRT runs inference only)"]
    return []


def _lstm(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    out = []
    if _attr(node, "input_forget", 0) != 0:
        out.append("`input_forget` must be 0")
    if _attr(node, "layout", 0) != 0:
        out.append("`layout` must be 0")
    return out


_RESIZE_COORDS = {"half_pixel", "pytorch_half_pixel", "tf_half_pixel_for_nn", "asymmetric", "align_corners"}
_RESIZE_NEAREST = {"floor", "ceil", "round_prefer_floor", "round_prefer_ceil"}


def _resize(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    out = []
    mode = _text(_attr(node, "mode", "nearest"))
    if mode not in ("nearest", "linear"):
        out.append(f"resize mode {mode!r} is unsupported (nearest, linear)")
    coords = _text(_attr(node, "coordinate_transformation_mode", "half_pixel"))
    if coords not in _RESIZE_COORDS:
        out.append(f"coordinate_transformation_mode {coords!r} is unsupported ({', '.join(sorted(_RESIZE_COORDS))})")
    nearest = _text(_attr(node, "nearest_mode", "round_prefer_floor"))
    if mode == "nearest" and nearest not in _RESIZE_NEAREST:
        out.append(f"nearest_mode {nearest!r} is unsupported")
    if _attr(node, "antialias", 0):
        out.append("antialiasing is not supported")
    policy = _text(_attr(node, "keep_aspect_ratio_policy", "stretch"))
    if policy != "stretch":
        out.append(f"keep_aspect_ratio_policy {policy!r} is unsupported (stretch only)")
    return out


def _topk(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    out = []
    if _attr(node, "sorted", 1) != 1:
        out.append("`sorted` must be 1")
    k = facts.constant(_input(node, 1)) if _input(node, 1) else None
    if k is not None and int(np.asarray(k).reshape(-1)[0]) >= 3840:
        out.append(f"K must be less than 3840, got {int(np.asarray(k).reshape(-1)[0])}")
    return out


def _scatter_nd(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    reduction = _text(_attr(node, "reduction", "none"))
    return [] if reduction == "none" else [f"reduction {reduction!r} is unsupported (none only)"]


def _constant(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    bad = [a.name for a in node.attribute if a.name in ("sparse_value", "value_string", "value_strings")]
    return [f"attribute `{b}` is unsupported" for b in bad]


def _layer_norm(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    return ["only the first output `Y` is supported"] if _count_named(node.output[1:]) else []


def _reduce(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    return _must_be_constant(node, facts, 1, "axes")


def _cumsum(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    return _must_be_constant(node, facts, 1, "axis")


def _onehot(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    return _must_be_constant(node, facts, 1, "depth")


def _stft(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    return _must_be_constant(node, facts, 1, "frame_step") + _must_be_constant(node, facts, 2, "window")


def _grid_sample(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    rank = facts.rank(_input(node, 0))
    if rank is not None and rank not in support.gridsample_ranks:
        allowed = " or ".join(f"{r}D" for r in sorted(support.gridsample_ranks))
        return [f"input must be {allowed}, this one is {rank}D"]
    return []


def _squeeze(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    has_axes = bool(_input(node, 1)) or _attr(node, "axes") is not None
    if not has_axes and not support.squeeze_without_axes:
        return [f"Squeeze without axes needs TensorRT 11.5 or newer (this table describes {support.describes})"]
    return []


def _attention(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    out = []
    for i, what in ((4, "past_key"), (5, "past_value"), (6, "nonpad_kv_seqlen")):
        if _input(node, i):
            out.append(f"input `{what}` is unsupported")
    for i, what in ((1, "present_key"), (2, "present_value"), (3, "qk_matmul_output")):
        if len(node.output) > i and node.output[i]:
            out.append(f"output `{what}` is unsupported")
    if _attr(node, "qk_matmul_output_mode", 0):
        out.append("attribute `qk_matmul_output_mode` is unsupported")
    if _attr(node, "softcap", 0.0):
        out.append("attribute `softcap` is unsupported")
    return out


def _tensor_scatter(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    axis = _attr(node, "axis", -2)
    return [] if axis == -2 else [f"`axis` must be -2, got {axis}"]


_REDUCE_OPS = (
    "ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare"
).split()

#: op_type -> check. Every entry corresponds to a row's Restrictions text in the matrix.
CHECKS: dict[str, Check] = {
    "AveragePool": _pool,
    "MaxPool": _pool,
    "LpPool": _pool,
    "QuantizeLinear": _quantize,
    "DequantizeLinear": _dequantize,
    "Dropout": _dropout,
    "LSTM": _lstm,
    "Resize": _resize,
    "TopK": _topk,
    "ScatterND": _scatter_nd,
    "Constant": _constant,
    "LayerNormalization": _layer_norm,
    "CumSum": _cumsum,
    "OneHot": _onehot,
    "STFT": _stft,
    "GridSample": _grid_sample,
    "Squeeze": _squeeze,
    "Attention": _attention,
    "TensorScatter": _tensor_scatter,
    **dict.fromkeys(_REDUCE_OPS, _reduce),
}


def node_problems(node: onnx.NodeProto, facts: GraphFacts, support: ParserSupport) -> list[str]:
    """Return why TensorRT's parser would refuse this (supported) op, or [] when it would not."""
    check = CHECKS.get(node.op_type)
    return check(node, facts, support) if check else []
