"""ONNX Runtime: the ONNX format, the onnxruntime target and the worker that also carries torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.descriptors._types import EngineDescriptor, FormatDescriptor, TargetDescriptor, WorkerImage

__all__ = ["DESCRIPTORS", "MAX_AUTO_EXCLUDE_ROUNDS", "OnnxRuntimeInt8Options", "OnnxRuntimeOptions"]

#: Each round re-calibrates the whole model; past a handful the artifact is mostly float anyway.
MAX_AUTO_EXCLUDE_ROUNDS = 8


class OnnxRuntimeInt8Options(BaseModel):
    """Static int8 quantisation (``options.onnxruntime.int8``), in onnxruntime.quantization's own terms."""

    model_config = ConfigDict(extra="forbid")

    calibrate_method: Literal["minmax", "entropy", "percentile"] = Field(
        default="minmax",
        description="quantize_static's calibrate_method: MinMax, Entropy (KL) or Percentile (99.999) activation ranges.",
    )
    quant_format: Literal["qdq", "qoperator"] = Field(
        default="qdq",
        description="QDQ (QuantizeLinear/DequantizeLinear around float ops) or QOperator (QLinearConv, QLinearMatMul...).",
    )
    per_channel: bool = Field(default=True, description="Per-output-channel weight scales (needs opset 13; upgraded).")
    activation_symmetric: bool = Field(
        default=False, description="extra_options ActivationSymmetric: activation ranges centred on zero."
    )
    nodes_to_exclude: list[str] = Field(
        default_factory=list, max_length=10_000, description="Node names left in float (quantize_static's own list)."
    )
    op_types_to_exclude: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="Op types left in float wherever they occur (e.g. Softmax, Sigmoid).",
    )
    auto_exclude: bool = Field(
        default=True,
        description=(
            "When the int8 model disagrees with fp32 on the calibration samples beyond the parity bounds (with "
            "`evaluation`: when it loses more than evaluation.max_drop on the labelled data), leave the nodes that "
            "lose most to quantisation in float and quantise again, until it holds or the rounds run out."
        ),
    )
    auto_exclude_rounds: int = Field(
        default=4, ge=1, le=MAX_AUTO_EXCLUDE_ROUNDS, description="At most this many re-quantisations by auto_exclude."
    )
    auto_percentile: bool = Field(
        default=True,
        description=(
            "With auto_exclude, when MinMax calibration misses, quantise once with Percentile (99.999) calibration "
            "too and go on from whichever does better (outlier activations clip MinMax's ranges)."
        ),
    )


class OnnxRuntimeOptions(BaseModel):
    """onnxruntime settings (``options.onnxruntime``): how the int8 artifact is quantised."""

    model_config = ConfigDict(extra="forbid")

    int8: OnnxRuntimeInt8Options = Field(
        default_factory=OnnxRuntimeInt8Options, description="Static int8 quantisation (precision int8)."
    )


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
        options=OnnxRuntimeOptions,
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
        device_bound="services.graph.device_checks:onnxruntime_on_gpu",
    ),
)
