"""OpenVINO: the IR format, the openvino target and the edges OpenVINO's converter provides."""

from __future__ import annotations

from services.descriptors._types import (
    ConverterDescriptor,
    EngineDescriptor,
    FormatDescriptor,
    TargetDescriptor,
    WorkerImage,
)

DESCRIPTORS = (
    EngineDescriptor(
        name="openvino",
        description="OpenVINO runtime, model conversion and NNCF",
        modules=("openvino",),
        extra="openvino",
        packages=("onnx", "openvino", "nncf", "numpy"),
        image=WorkerImage(extras=("openvino", "service")),
        preload=("openvino", "onnxruntime", "services.exporters.openvino", "services.converters.openvino_ir"),
    ),
    FormatDescriptor(
        name="openvino_ir",
        label="OpenVINO IR (.xml+.bin)",
        extensions=(".xml",),
        runner="services.runners.openvino:OpenVINORunner",
        source_engine="openvino",
    ),
    TargetDescriptor(
        name="openvino",
        engine="openvino",
        accepts={"openvino_ir": 1.0},
        entry="services.exporters.openvino:export_openvino",
        artifact_format="openvino_ir",
        server_root="triton",
    ),
    ConverterDescriptor(
        "onnx-to-openvino-ir",
        "onnx",
        "openvino_ir",
        "openvino",
        1.0,
        "services.converters.openvino_ir:onnx_to_ir",
        "openvino.convert_model",
    ),
    ConverterDescriptor(
        "savedmodel-to-openvino-ir",
        "savedmodel",
        "openvino_ir",
        "openvino",
        1.5,
        "services.converters.openvino_ir:savedmodel_to_ir",
        "openvino.convert_model",
    ),
    ConverterDescriptor(
        "tflite-to-openvino-ir",
        "tflite",
        "openvino_ir",
        "openvino",
        1.5,
        "services.converters.openvino_ir:tflite_to_ir",
        "openvino.convert_model",
    ),
)
