"""PyTorch sources (TorchScript, torch.export): read and converted on the onnxruntime worker."""

from __future__ import annotations

from services.descriptors._types import ConverterDescriptor, FormatDescriptor

DESCRIPTORS = (
    FormatDescriptor(
        name="torchscript",
        label="TorchScript (.pt)",
        extensions=(".pt",),
        runner="services.runners.torch:TorchScriptRunner",
        source_engine="onnxruntime",  # the onnxruntime image carries torch for the importers
        archive_is_the_model=True,  # a zip its loader reads whole
        vet="services.formats.torchscript:vet_torchscript",
    ),
    FormatDescriptor(
        name="torch_export",
        label="torch.export (.pt2)",
        extensions=(".pt2",),
        runner="services.runners.torch:ExportedProgramRunner",
        source_engine="onnxruntime",
        archive_is_the_model=True,  # a zip its loader reads whole
    ),
    ConverterDescriptor(
        "torchscript-to-onnx",
        "torchscript",
        "onnx",
        "onnxruntime",
        3.0,
        "services.converters.torch_to_onnx:torchscript_to_onnx",
        "torch.onnx",
    ),
    ConverterDescriptor(
        "torch-export-to-onnx",
        "torch_export",
        "onnx",
        "onnxruntime",
        2.0,
        "services.converters.torch_to_onnx:exported_program_to_onnx",
        "torch.onnx (dynamo)",
    ),
)
