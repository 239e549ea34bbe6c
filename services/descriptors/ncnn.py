"""ncnn: the ncnn target (.param + .bin for apps that embed ncnn), converted by pnnx, and its worker."""

from __future__ import annotations

from services.descriptors._types import EngineDescriptor, FormatDescriptor, TargetDescriptor, WorkerImage

DESCRIPTORS = (
    EngineDescriptor(
        name="ncnn",
        description="ncnn runtime and its pnnx converter (ONNX, TorchScript)",
        modules=("ncnn", "pnnx"),
        extra="ncnn",
        packages=("ncnn", "pnnx", "onnx", "numpy"),
        # pnnx's metadata requires torch (its converter binary does not): `torch` selects the CPU wheel's index.
        image=WorkerImage(extras=("ncnn", "torch", "service")),
        # Not ncnn itself: its OpenMP pool must start after the fork.
        preload=("services.exporters.ncnn",),
    ),
    FormatDescriptor(
        name="ncnn",
        label="ncnn model (.param + .bin)",
        extensions=(".param",),
        runner="services.runners.ncnn:NcnnRunner",
        source_engine="ncnn",
        not_a_source=(
            "an ncnn model is a target artifact, not a source Kiln converts from",
            "Submit the ONNX (or framework) model the .param/.bin were converted from.",
        ),
    ),
    TargetDescriptor(
        name="ncnn",
        engine="ncnn",
        # pnnx reads TorchScript itself: no ONNX round trip for a .pt source.
        accepts={"onnx": 1.5, "torchscript": 1.5},
        entry="services.exporters.ncnn:export_ncnn",
        artifact_format="ncnn",
        server_root="ncnn",
        precisions={"onnx": frozenset({"fp32", "fp16"}), "torchscript": frozenset({"fp32", "fp16"})},
    ),
)
