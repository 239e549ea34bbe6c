"""MNN: the mnn target (a .mnn file for apps and services that embed MNN) and its worker."""

from __future__ import annotations

from services.descriptors._types import EngineDescriptor, FormatDescriptor, TargetDescriptor, WorkerImage

DESCRIPTORS = (
    EngineDescriptor(
        name="mnn",
        description="MNN runtime and its converter/quantiser (mobile and edge)",
        # _tools is the wheel's compiled converter/quantiser; the exporter needs both.
        modules=("MNN", "_tools"),
        extra="mnn",
        packages=("mnn", "onnx", "numpy"),
        image=WorkerImage(extras=("mnn", "service")),
        # Not MNN itself: its converter runs in a process of its own (services/exporters/mnn_tool.py).
        preload=("services.exporters.mnn",),
    ),
    FormatDescriptor(
        name="mnn",
        label="MNN model (.mnn)",
        extensions=(".mnn",),
        runner="services.runners.mnn:MnnRunner",
        source_engine="mnn",
        not_a_source=(
            "an MNN model is a target artifact, not a source Kiln converts from",
            "Submit the ONNX (or framework) model the .mnn was converted from.",
        ),
    ),
    TargetDescriptor(
        name="mnn",
        engine="mnn",
        # Caffe natively (MNNConvert -f CAFFE, services.exporters.mnn.MnnSource): cheaper than
        # caffe -> onnx -> optimise -> mnn, which stays the fallback route and the int8 route.
        accepts={"onnx": 1.5, "caffe": 1.5},
        entry="services.exporters.mnn:export_mnn",
        artifact_format="mnn",
        server_root="mnn",
        precisions={"onnx": frozenset({"fp32", "fp16", "int8"}), "caffe": frozenset({"fp32", "fp16"})},
    ),
)
