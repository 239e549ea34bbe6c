"""ONNX Runtime: the ONNX format, the onnxruntime target and the worker that also carries torch."""

from __future__ import annotations

from services.descriptors._types import EngineDescriptor, FormatDescriptor, TargetDescriptor, WorkerImage

DESCRIPTORS = (
    EngineDescriptor(
        name="onnxruntime",
        description="ONNX Runtime; also runs the PyTorch importers",
        modules=("onnxruntime", "onnx"),
        extra="onnxruntime",
        packages=(
            "onnx",
            "onnxruntime",
            "onnxscript",
            "onnx-ir",
            "onnxslim",
            "torch",
            "transformers",
            "safetensors",
            "numpy",
            "opencv-python-headless",
        ),
        # torch carries the TorchScript / torch.export importers (services/descriptors/torch.py), and with
        # transformers and safetensors (the same extra) the Hugging Face source (services/descriptors/huggingface.py);
        # opencv-python-headless (the onnxruntime extra) the Caffe reference runner (services/descriptors/caffe.py).
        image=WorkerImage(extras=("onnxruntime", "torch", "service")),
        preload=("onnxruntime", "services.exporters.onnxruntime", "services.passes.step"),
    ),
    FormatDescriptor(
        name="onnx",
        label="ONNX",
        extensions=(".onnx",),
        runner="services.runners.onnx:OnnxRuntimeRunner",
        source_engine="onnxruntime",
        vet="services.formats.onnx_model:vet_onnx",
    ),
    TargetDescriptor(
        name="onnxruntime",
        engine="onnxruntime",
        accepts={"onnx": 1.0},
        entry="services.exporters.onnxruntime:export_onnxruntime",
        artifact_format="onnx",
        server_root="triton",
    ),
)
