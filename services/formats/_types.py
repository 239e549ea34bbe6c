"""The model formats Kiln knows, as the converter graph's nodes."""

from __future__ import annotations

from enum import Enum

__all__ = ["Format"]


class Format(str, Enum):
    """What a model file is; the nodes of the converter graph."""

    ONNX = "onnx"
    KERAS = "keras"
    SAVEDMODEL = "savedmodel"
    TFLITE = "tflite"
    TORCHSCRIPT = "torchscript"
    TORCH_EXPORT = "torch_export"
    OPENVINO_IR = "openvino_ir"
    TENSORRT_PLAN = "tensorrt_plan"
    TVM_LIBRARY = "tvm_library"
