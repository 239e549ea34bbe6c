"""The model formats Kiln knows, as the converter graph's nodes: one member per FormatDescriptor."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from services.descriptors import registry

__all__ = ["Format"]

if TYPE_CHECKING:
    # The built-in members, spelled out for the type checker; at run time the enum holds
    # every registered format (services/descriptors), these first, so new formats need no edit here.
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

else:
    Format = Enum(
        "Format",
        [(name.upper(), name) for name in registry().formats],
        type=str,
        module=__name__,
        qualname="Format",
    )
    Format.__doc__ = "What a model file is; the nodes of the converter graph."
