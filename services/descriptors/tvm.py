"""Apache TVM: the tvm target (ONNX compiled into a native library for the worker's CPU) and its worker."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from services.descriptors._types import EngineDescriptor, FormatDescriptor, TargetDescriptor, WorkerImage

__all__ = ["DESCRIPTORS", "MAX_TUNING_TRIALS", "TvmOptions"]

#: A budget far past what one compile job should spend; MetaSchedule's own examples use 20000.
MAX_TUNING_TRIALS = 100_000


class TvmOptions(BaseModel):
    """TVM settings (``options.tvm``): CPU model, an optional CUDA library, MetaSchedule tuning."""

    model_config = ConfigDict(extra="forbid")

    mcpu: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.+-]{1,64}$",
        description="LLVM CPU to compile for (e.g. znver4, skylake-avx512, x86-64-v3); unset: the worker's own CPU.",
    )
    cuda_arch: str | None = Field(
        default=None,
        pattern=r"^sm_[0-9]{2,3}[af]?$",
        description=(
            "Also cross-compile a CUDA library (model_cuda.so) for this GPU architecture, e.g. sm_90; it is built "
            "without a GPU and not run by Kiln (parity is checked on the CPU library)."
        ),
    )
    tuning_trials: int = Field(
        default=0,
        ge=0,
        le=MAX_TUNING_TRIALS,
        description=(
            "MetaSchedule trial budget for the CPU library (0: untuned, TVM's default schedules). Tuning needs "
            "static shapes: open axes take the spec's inputs shape (or opt)."
        ),
    )


DESCRIPTORS = (
    EngineDescriptor(
        name="tvm",
        description="Apache TVM: ONNX compiled to CPU (and cross-compiled CUDA) libraries",
        modules=("tvm",),
        extra="tvm",
        packages=("apache-tvm", "apache-tvm-ffi", "onnx", "numpy"),
        image=WorkerImage(extras=("tvm", "service")),
        # Not tvm itself: its import takes 7 to 30 s here, which every all-engine worker (kiln serve)
        # would pay before its first step of any engine; a tvm step imports it in its child instead.
        preload=("services.exporters.tvm",),
        options=TvmOptions,
        # Its libraries are compiled for the worker's CPU (unless options.tvm.mcpu names one):
        # another CPU needs its own build, so the CPU is part of the tvm steps' cache keys.
        extra_versions="services.tvm.host:host_versions",
    ),
    FormatDescriptor(
        name="tvm_library",
        label="TVM library (model.so + params.bin + io.json)",
        runner="services.runners.tvm:TvmRunner",
        source_engine="tvm",
        not_a_source=(
            "a TVM library is compiled machine code and cannot be converted",
            "Submit the ONNX (or framework) model the library was built from.",
        ),
    ),
    TargetDescriptor(
        name="tvm",
        engine="tvm",
        accepts={"onnx": 1.5},
        entry="services.exporters.tvm:export_tvm",
        artifact_format="tvm_library",
        server_root="tvm",
        precisions={"onnx": frozenset({"fp32", "fp16"})},
    ),
)
