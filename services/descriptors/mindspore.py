"""MindSpore: MindIR sources, read (nn.GraphCell) and converted to ONNX on their own worker.

MindSpore is an 800 MB wheel (2.4 GB installed), so it has its own image and queue
(``kiln.mindspore``) rather than riding in the onnxruntime image; the ONNX it produces goes
on to the other engines' workers like any other.
"""

from __future__ import annotations

from services.descriptors._types import ConverterDescriptor, EngineDescriptor, FormatDescriptor, WorkerImage

DESCRIPTORS = (
    EngineDescriptor(
        name="mindspore",
        description="MindSpore: runs MindIR sources and exports them to ONNX",
        modules=("mindspore",),
        extra="mindspore",
        packages=("mindspore", "onnx", "protobuf", "numpy"),
        image=WorkerImage(extras=("mindspore", "service")),
        preload=(),  # MindSpore's fork safety is untested: nothing preloaded in the forkserver
    ),
    FormatDescriptor(
        name="mindir",
        label="MindSpore MindIR (.mindir)",
        extensions=(".mindir",),
        runner="services.runners.mindir:MindIRRunner",
        source_engine="mindspore",
        detect="services.formats.mindir:sniff_mindir",  # the header: producer "MindSpore"
        vet="services.formats.mindir:vet_mindir_upload",  # at submission, without MindSpore
    ),
    ConverterDescriptor(
        "mindir-to-onnx",
        "mindir",
        "onnx",
        "mindspore",
        2.0,
        "services.converters.mindir_to_onnx:mindir_to_onnx_mindspore",
        "mindspore.onnx.export",
    ),
    ConverterDescriptor(  # the fallback route: Kiln's own mapping over MindIR's protobuf
        "mindir-protobuf-to-onnx",
        "mindir",
        "onnx",
        "mindspore",
        2.5,
        "services.converters.mindir_to_onnx:mindir_to_onnx",
        "kiln mindir_to_onnx",
    ),
)
