"""The converter graph: every edge format → format, and every target's exporter, in one place.

Edges and exporters name their implementation as ``"module:function"`` and are imported
only when a step runs, so the planner (and the API, which never imports engine SDKs) can
reason about routes without TensorFlow, torch or OpenVINO installed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from services.formats import Format
from services.spec import Precision, TargetName

__all__ = [
    "OPTIMIZE_ENTRY",
    "PUBLISH_ENTRY",
    "REFERENCE_ENTRY",
    "Converter",
    "Exporter",
    "Registry",
    "default_registry",
    "load_entry",
    "source_engine",
]

ALL_PRECISIONS = frozenset(Precision)
#: int4 is weight-only MatMul compression, built only by onnxruntime (MatMulNBits) and
#: OpenVINO (NNCF); the other targets have no int4 kernels to serve it with.
WITHOUT_INT4 = ALL_PRECISIONS - {Precision.INT4}


@dataclass(frozen=True)
class Converter:
    """An edge of the graph: a faithful fp32 conversion from one format to another."""

    name: str
    source: Format
    target: Format
    engine: str  # engine family whose worker runs it: onnxruntime, openvino, tensorflow, tensorrt
    cost: float
    entry: str  # "module:function", called with a StepContext, returns an Artifact
    tool: str  # the library doing the work, for `kiln routes` and the manifest


@dataclass(frozen=True)
class Exporter:
    """The last step of a target: precision, engine-native artifact, parity, benchmark."""

    target: TargetName
    engine: str
    accepts: dict[Format, float]  # input format -> cost of exporting from it
    entry: str
    precisions: dict[Format, frozenset[Precision]] = field(default_factory=dict)  # default: all
    artifact_format: Format | None = None

    def supports(self, fmt: Format, precision: Precision) -> bool:
        """Return True when this exporter can produce ``precision`` from ``fmt``."""
        return fmt in self.accepts and precision in self.precisions.get(fmt, ALL_PRECISIONS)


class Registry:
    """Converters by name and exporters by target; refuses silent overwrites."""

    def __init__(self) -> None:
        self._converters: dict[str, Converter] = {}
        self._exporters: dict[TargetName, Exporter] = {}

    def add_converter(self, conv: Converter, *, replace: bool = False) -> None:
        if conv.name in self._converters and not replace:
            raise ValueError(f"converter {conv.name!r} is already registered")
        self._converters[conv.name] = conv

    def add_exporter(self, exp: Exporter, *, replace: bool = False) -> None:
        if exp.target in self._exporters and not replace:
            raise ValueError(f"exporter for {exp.target.value!r} is already registered")
        self._exporters[exp.target] = exp

    @property
    def converters(self) -> list[Converter]:
        return list(self._converters.values())

    @property
    def exporters(self) -> list[Exporter]:
        return list(self._exporters.values())

    def converter(self, name: str) -> Converter:
        try:
            return self._converters[name]
        except KeyError:
            raise KeyError(f"no converter {name!r}; known: {', '.join(sorted(self._converters))}") from None

    def exporter(self, target: TargetName) -> Exporter:
        try:
            return self._exporters[target]
        except KeyError:
            known = ", ".join(sorted(t.value for t in self._exporters))
            raise KeyError(f"no exporter for {target.value!r}; known: {known}") from None

    def edges_from(self, fmt: Format) -> list[Converter]:
        return [c for c in self._converters.values() if c.source is fmt]

    def engines(self) -> set[str]:
        """Return every engine family some edge or exporter runs on."""
        return {c.engine for c in self._converters.values()} | {e.engine for e in self._exporters.values()}


def load_entry(entry: str) -> Callable[..., Any]:
    """Import ``"module:function"`` and return the function."""
    module, _, func = entry.partition(":")
    return getattr(importlib.import_module(module), func)  # type: ignore[no-any-return]


#: Which engine reads a source format natively (computes reference outputs, inspects it).
_SOURCE_ENGINE: dict[Format, str] = {
    Format.ONNX: "onnxruntime",
    Format.TORCHSCRIPT: "onnxruntime",  # the onnxruntime image carries torch for the importers
    Format.TORCH_EXPORT: "onnxruntime",
    Format.KERAS: "tensorflow",
    Format.SAVEDMODEL: "tensorflow",
    Format.TFLITE: "tensorflow",
    Format.OPENVINO_IR: "openvino",
    Format.TENSORRT_PLAN: "tensorrt",
}


def source_engine(fmt: Format) -> str:
    """Return the engine family whose worker reads ``fmt`` as a source."""
    return _SOURCE_ENGINE[fmt]


REFERENCE_ENTRY = "services.pipeline.reference:run_reference_step"
OPTIMIZE_ENTRY = "services.passes.step:run_optimize_step"
PUBLISH_ENTRY = "services.repository.step:run_publish_step"


def _converters() -> Iterable[Converter]:
    C = Converter
    F = Format
    return (
        # --- to ONNX, the canonical graph ---
        C(
            "keras-to-onnx",
            F.KERAS,
            F.ONNX,
            "tensorflow",
            3.0,
            "services.converters.tensorflow_to_onnx:keras_to_onnx",
            "tf2onnx",
        ),
        C(
            "savedmodel-to-onnx",
            F.SAVEDMODEL,
            F.ONNX,
            "tensorflow",
            3.0,
            "services.converters.tensorflow_to_onnx:savedmodel_to_onnx",
            "tf2onnx",
        ),
        C(
            "tflite-to-onnx",
            F.TFLITE,
            F.ONNX,
            "tensorflow",
            3.0,
            "services.converters.tensorflow_to_onnx:tflite_to_onnx",
            "tf2onnx",
        ),
        C(
            "torchscript-to-onnx",
            F.TORCHSCRIPT,
            F.ONNX,
            "onnxruntime",
            3.0,
            "services.converters.torch_to_onnx:torchscript_to_onnx",
            "torch.onnx",
        ),
        C(
            "torch-export-to-onnx",
            F.TORCH_EXPORT,
            F.ONNX,
            "onnxruntime",
            2.0,
            "services.converters.torch_to_onnx:exported_program_to_onnx",
            "torch.onnx (dynamo)",
        ),
        # --- native TensorFlow routes (no ONNX round trip) ---
        C(
            "keras-to-savedmodel",
            F.KERAS,
            F.SAVEDMODEL,
            "tensorflow",
            1.0,
            "services.converters.tensorflow_native:keras_to_savedmodel",
            "tf.saved_model",
        ),
        C(
            "onnx-to-savedmodel",
            F.ONNX,
            F.SAVEDMODEL,
            "tensorflow",
            4.0,
            "services.converters.onnx_to_tensorflow:onnx_to_savedmodel",
            "onnx2tf",
        ),
        # --- OpenVINO IR ---
        C(
            "onnx-to-openvino-ir",
            F.ONNX,
            F.OPENVINO_IR,
            "openvino",
            1.0,
            "services.converters.openvino_ir:onnx_to_ir",
            "openvino.convert_model",
        ),
        C(
            "savedmodel-to-openvino-ir",
            F.SAVEDMODEL,
            F.OPENVINO_IR,
            "openvino",
            1.5,
            "services.converters.openvino_ir:savedmodel_to_ir",
            "openvino.convert_model",
        ),
        C(
            "tflite-to-openvino-ir",
            F.TFLITE,
            F.OPENVINO_IR,
            "openvino",
            1.5,
            "services.converters.openvino_ir:tflite_to_ir",
            "openvino.convert_model",
        ),
    )


def _exporters() -> Iterable[Exporter]:
    F = Format
    P = Precision
    return (
        Exporter(
            TargetName.ONNXRUNTIME,
            "onnxruntime",
            {F.ONNX: 1.0},
            "services.exporters.onnxruntime:export_onnxruntime",
            artifact_format=F.ONNX,
        ),
        Exporter(
            TargetName.OPENVINO,
            "openvino",
            {F.OPENVINO_IR: 1.0},
            "services.exporters.openvino:export_openvino",
            artifact_format=F.OPENVINO_IR,
        ),
        Exporter(
            TargetName.TFLITE,
            "tensorflow",
            # Keras arrives as keras-to-savedmodel's output: TF's converter exports Keras 3 models to a
            # SavedModel internally anyway, and as a step it is cached and shared with tfserving/openvino.
            {F.SAVEDMODEL: 1.5, F.TFLITE: 0.5},
            "services.exporters.tflite:export_tflite",
            precisions={F.SAVEDMODEL: WITHOUT_INT4, F.TFLITE: frozenset({P.FP32})},
            artifact_format=F.TFLITE,
        ),
        Exporter(
            TargetName.TFSERVING,
            "tensorflow",
            {F.SAVEDMODEL: 1.0},
            "services.exporters.tfserving:export_tfserving",
            # fp16/int8: weights stored at that precision, fp32 compute (see services/exporters/tfserving.py)
            precisions={F.SAVEDMODEL: WITHOUT_INT4},
            artifact_format=F.SAVEDMODEL,
        ),
        Exporter(
            TargetName.TENSORRT,
            "tensorrt",
            {F.ONNX: 2.0},
            "services.exporters.tensorrt:export_tensorrt",
            precisions={F.ONNX: WITHOUT_INT4},
            artifact_format=F.TENSORRT_PLAN,
        ),
        Exporter(
            TargetName.TVM,
            "tvm",
            {F.ONNX: 1.5},
            "services.exporters.tvm:export_tvm",
            precisions={F.ONNX: frozenset({P.FP32, P.FP16})},
            artifact_format=F.TVM_LIBRARY,
        ),
    )


_DEFAULT: Registry | None = None


def default_registry() -> Registry:
    """Return the process-wide registry of Kiln's real converters and exporters."""
    global _DEFAULT
    if _DEFAULT is None:
        reg = Registry()
        for c in _converters():
            reg.add_converter(c)
        for e in _exporters():
            reg.add_exporter(e)
        _DEFAULT = reg
    return _DEFAULT
