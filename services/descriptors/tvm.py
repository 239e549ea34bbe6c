"""Apache TVM: the tvm target (ONNX compiled into a native library for the worker's CPU) and its worker."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from services.descriptors._types import EngineDescriptor, FormatDescriptor, TargetDescriptor, WorkerImage

__all__ = ["DEFAULT_TUNING_SECONDS", "DEFAULT_TUNING_TRIALS", "DESCRIPTORS", "MAX_TUNING_TRIALS", "TvmOptions"]

#: A budget far past what one compile job should spend; MetaSchedule's own examples use 20000.
MAX_TUNING_TRIALS = 100_000
#: The MetaSchedule budget a library built at static shapes gets when the spec names none
#: (docs/benchmarks.md, "TVM target": what it buys against onnxruntime and what it costs).
DEFAULT_TUNING_TRIALS = 300
#: Wall-clock bound on one library's tuning; candidates after it are not built (the search ends).
DEFAULT_TUNING_SECONDS = 1200


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
    tuning_trials: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TUNING_TRIALS,
        description=(
            "MetaSchedule trial budget for the CPU library (0: untuned, TVM's default schedules). Unset: "
            f"{DEFAULT_TUNING_TRIALS} trials when the library is built at static shapes (the model's own, or fixed "
            "ones Kiln fell back to), untuned at open axes. A number given tunes at static shapes: open axes take "
            "the spec's inputs shape (or opt). Kernels tuned by earlier jobs on the same CPU are reused."
        ),
    )
    fast_math: bool = Field(
        default=True,
        description=(
            "Compute exp, erf, tanh and softmax with TVM's fast approximations (vectorised polynomials, float32; "
            "measured max abs error ~1e-6 on a transformer block, which parity checks as always); false: the exact "
            "functions, one libm call per element."
        ),
    )
    tuning_seconds: int = Field(
        default=DEFAULT_TUNING_SECONDS,
        ge=10,
        le=86_400,
        description="Wall-clock bound on tuning one library: candidates after it are not built, the best so far is kept.",
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
        device_bound="services.graph.device_checks:tvm_cuda_library",
    ),
)
