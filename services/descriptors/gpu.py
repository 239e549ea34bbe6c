"""The GPU worker: checks and times GPU-bound artifacts on the NVIDIA GPU that will serve them.

It builds nothing. Another engine's worker exports the artifact (onnxruntime's model.onnx for
``serving.onnxruntime_device: gpu``, TVM's model_cuda.so for ``options.tvm.cuda_arch``); the plan's
``check:<target>`` step then runs on this engine's queue (kiln.gpu-<variant>), where parity against
the source and the benchmark run on the GPU: onnxruntime's CUDA execution provider (and TensorRT's,
where the image has it), TVM's CUDA runtime. One image and queue per CUDA major version, like
TensorRT's; its image is built from PyPI wheels alone (onnxruntime-gpu and NVIDIA's runtime wheels).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from services.descriptors._types import EngineDescriptor, WorkerImage

__all__ = ["DESCRIPTORS", "GPU_ENGINE", "VARIANTS", "GpuOptions"]

GPU_ENGINE = "gpu"

#: variant -> what its image carries. Each has its own image and queue (kiln.gpu-<variant>).
VARIANTS = {"cu13": "NVIDIA GPU on CUDA 13: onnxruntime-gpu 1.31 (CUDA and TensorRT providers), TVM's CUDA runtime"}


class GpuOptions(BaseModel):
    """GPU worker settings (``options.gpu``): which worker checks GPU-bound artifacts."""

    model_config = ConfigDict(extra="forbid")

    variant: str = Field(
        default="cu13",
        pattern="^(" + "|".join(VARIANTS) + ")$",
        description="GPU worker variant (queue kiln.gpu-<variant>): " + ", ".join(VARIANTS) + ".",
    )


DESCRIPTORS = (
    EngineDescriptor(
        name=GPU_ENGINE,
        description="NVIDIA GPU: parity and benchmark of GPU-bound artifacts on the GPU",
        # onnxruntime (the onnxruntime-gpu wheel provides it) and NVML's bindings; the GPU itself is the
        # `device` check: a CPU box with onnxruntime installed must not take the GPU queue.
        modules=("onnxruntime", "pynvml"),
        extra="gpu",
        packages=("onnxruntime-gpu", "onnxruntime", "apache-tvm", "apache-tvm-ffi", "onnx", "numpy"),
        image=WorkerImage(extras=("gpu", "service"), dockerfile="docker/gpu.Dockerfile", build_target=None, gpus=1),
        variants=VARIANTS,
        default_variant="cu13",
        options=GpuOptions,
        # The GPU, its driver and CUDA version: a check's numbers are the device's, so they key its cache.
        extra_versions="services.gpu.device:device_versions",
        device="services.gpu.device:gpu_engine_unavailable",
    ),
)
