"""TensorRT: the tensorrt target (a plan for Triton), one worker image and queue per CUDA variant."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from services.descriptors._types import EngineDescriptor, FormatDescriptor, TargetDescriptor, WorkerImage

#: 1 TiB: more than any GPU has.
MAX_WORKSPACE_MB = 1 << 20

#: TensorRT ships per CUDA major version: variant -> (TensorRT major, CUDA major). Each variant has
#: its own image and queue (kiln.tensorrt-<variant>); this table is the only place they are listed.
_BUILDS = {"cu12": (10, 12), "cu13": (11, 13)}
VARIANTS = {variant: f"TensorRT {trt}.x on CUDA {cuda}" for variant, (trt, cuda) in _BUILDS.items()}


def variant_major(variant: str) -> int:
    """Return the TensorRT major version a worker variant carries ("cu13" → 11)."""
    try:
        return _BUILDS[variant][0]
    except KeyError:
        # Imported here: a descriptor module imports only services.descriptors and pydantic when loaded.
        from services.errors import EngineUnavailable

        raise EngineUnavailable(
            f"unknown TensorRT variant {variant!r}", hint="Known variants: " + ", ".join(sorted(VARIANTS))
        ) from None


class TensorRTOptions(BaseModel):
    """TensorRT settings (``options.tensorrt``): which worker builds the plan, and with how much memory."""

    model_config = ConfigDict(extra="forbid")

    # Only the variants there are workers and queues for: another (`cu01`) planned a queue no
    # worker could ever serve, and the job was refused as ENGINE_UNAVAILABLE (503) instead of 422.
    variant: str = Field(
        default="cu13",
        pattern="^(" + "|".join(VARIANTS) + ")$",
        description="TensorRT worker variant (queue kiln.tensorrt-<variant>): " + ", ".join(VARIANTS) + ".",
    )
    workspace_mb: int = Field(default=2048, ge=64, le=MAX_WORKSPACE_MB, description="TensorRT builder workspace limit.")


DESCRIPTORS = (
    EngineDescriptor(
        name="tensorrt",
        description="TensorRT",
        modules=("tensorrt",),
        extra="tensorrt",
        packages=("tensorrt", "cuda-python", "onnxruntime", "onnx", "numpy"),
        image=WorkerImage(
            extras=("tensorrt", "service"), dockerfile="docker/tensorrt.Dockerfile", build_target=None, gpus=1
        ),
        variants=VARIANTS,
        default_variant="cu13",
        options=TensorRTOptions,
        legacy_spec_fields={"tensorrt_variant": "variant", "tensorrt_workspace_mb": "workspace_mb"},
    ),
    FormatDescriptor(
        name="tensorrt_plan",
        label="TensorRT plan",
        extensions=(".plan", ".engine"),
        runner="services.runners.tensorrt:TensorRTRunner",
        source_engine="tensorrt",
        not_a_source=(
            "a TensorRT plan is an engine-specific binary and cannot be converted",
            "Submit the ONNX (or framework) model the plan was built from.",
        ),
    ),
    TargetDescriptor(
        name="tensorrt",
        engine="tensorrt",
        accepts={"onnx": 2.0},
        entry="services.exporters.tensorrt:export_tensorrt",
        artifact_format="tensorrt_plan",
        server_root="triton",
        precisions={"onnx": frozenset({"fp32", "fp16", "int8"})},
        preflight="services.exporters.tensorrt_submission:check_submission",
    ),
)
