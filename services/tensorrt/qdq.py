"""The explicitly quantized ONNX TensorRT builds int8 engines from: Q/DQ nodes, symmetric int8.

TensorRT 11 has no calibrators and TensorRT 10 prefers explicit quantization, so int8 scales
travel in the ONNX as QuantizeLinear/DequantizeLinear pairs. onnxruntime's static quantizer
writes them, calibrated on the job's calibration data (or, labelled as such, its generated
samples). The settings follow what TensorRT's parser accepts (see the DequantizeLinear and
QuantizeLinear rows of :mod:`services.tensorrt.onnx_support`):

* int8 for activations and weights, both symmetric — TensorRT requires zero points of 0;
* biases stay float — TensorRT cannot dequantize the INT32 biases onnxruntime would write;
* only the inputs of Conv, ConvTranspose, Gemm and MatMul are quantized — the layers TensorRT
  runs in int8 and fuses the Q/DQ into; TensorRT propagates scales through the rest;
* weights per output channel when the opset allows it (13+), per tensor otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from services.onnx_io import load_onnx

__all__ = ["QUANTIZED_OPS", "make_qdq_model", "zero_points"]

QUANTIZED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


class _Feeds:
    """onnxruntime's CalibrationDataReader protocol over a list of feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self._feeds = feeds
        self._it: Iterator[dict[str, np.ndarray]] = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self._feeds)


def make_qdq_model(src: Path, dst: Path, feeds: list[dict[str, np.ndarray]], scratch: Path) -> dict[str, Any]:
    """Write a symmetric int8 Q/DQ copy of ``src`` to ``dst``, calibrated on ``feeds``; return the settings."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    scratch.mkdir(parents=True, exist_ok=True)
    pre = scratch / "qdq-preprocessed.onnx"
    # Shape inference and folding first: the quantizer needs tensor shapes to pick per-channel axes.
    quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
    opset = next(
        (o.version for o in load_onnx(pre, load_external_data=False).opset_import if o.domain in ("", "ai.onnx")), 0
    )
    per_channel = opset >= 13
    quantize_static(
        str(pre),
        str(dst),
        _Feeds(feeds),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=list(QUANTIZED_OPS),
        per_channel=per_channel,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False},
    )
    return {
        "format": "QDQ",
        "activations": "int8 symmetric",
        "weights": "int8 symmetric" + (" per channel" if per_channel else " per tensor"),
        "bias": "float (not quantized)",
        "quantized_ops": list(QUANTIZED_OPS),
        "calibration_method": "MinMax",
        "samples": len(feeds),
        "tool": "onnxruntime.quantization.quantize_static",
    }


def zero_points(path: Path) -> dict[str, np.ndarray]:
    """Return every Q/DQ zero point in a model, by tensor name (for checks and reports)."""
    from onnx import numpy_helper

    model = load_onnx(path)
    inits = {i.name: i for i in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2 and node.input[2]:
            name = node.input[2]
            if name in inits:
                out[name] = numpy_helper.to_array(inits[name])
    return out
