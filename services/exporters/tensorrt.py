"""The tensorrt target: a serialized TensorRT plan (model.plan) served by Triton's tensorrt_plan platform.

Steps, cheapest failure first:

1. pre-flight — the ONNX ops, types and restrictions against TensorRT's parser table
   (UNSUPPORTED_OPS with ``{op: count}``), without TensorRT, so a model TensorRT cannot take
   fails in seconds;
2. the optimization profile from the graph and the spec (INVALID_SPEC names a missing range);
3. TensorRT itself (ENGINE_UNAVAILABLE when this worker lacks it — never a fake success);
4. precision preparation, per TensorRT API generation (see :mod:`services.tensorrt.builder`):
   int8 is always a symmetric Q/DQ ONNX; fp16 is a builder flag on 10.x and an fp16 ONNX with
   fp32 I/O on 11.x; the prepared ONNX is pre-flighted again;
5. the build, with the workspace limit and the per-architecture timing cache;
6. parity against the source and a benchmark on the GPU (``finish_export``).

The TensorRT version, compute capability, profiles, workspace and timing cache go into
``engine_details``, which the provenance manifest carries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.artifacts import Artifact
from services.descriptors.tensorrt import TensorRTOptions, variant_major
from services.errors import EngineUnavailable
from services.exporters._common import calibration_feeds, calibration_warnings, finish_export
from services.formats import Format
from services.onnx_io import load_onnx
from services.settings import get_settings
from services.spec import Precision
from services.steps.context import StepContext
from services.steps.reference import load_reference
from services.tensorrt.builder import BuildOptions, build_plan, import_tensorrt, tensorrt_major
from services.tensorrt.preflight import require_tensorrt_support
from services.tensorrt.profiles import ShapeProfile, derive_profile

__all__ = ["MODEL_FILE", "export_tensorrt", "serving_for"]

MODEL_FILE = "model.plan"


def serving_for(profile: ShapeProfile) -> dict[str, Any]:
    """Return the serving description publish_version turns into Triton's config.pbtxt."""
    triton: dict[str, Any] = {"platform": "tensorrt_plan", "instance_kind": "KIND_GPU"}
    if not profile.dynamic_batch or not profile.inputs:
        # Triton owns axis 0 only when every input's batch axis is dynamic in the engine.
        triton["batching"] = False
    else:
        # The engine accepts no batch above its profile's; Triton must not form larger ones.
        triton["max_batch_size"] = min(p.max[0] for p in profile.inputs)
    return {"triton": triton}


def _installed_major() -> int | None:
    try:
        return tensorrt_major(import_tensorrt())
    except EngineUnavailable:
        return None


def _prepare(ctx: StepContext, src: Path, precision: Precision, major: int) -> tuple[Path, dict[str, Any]]:
    """Return the ONNX to build from and what was done to it for ``precision``."""
    if precision is Precision.FP32:
        return src, {}
    work = ctx.scratch / f"tensorrt-{precision.value}"
    work.mkdir(parents=True, exist_ok=True)
    try:
        if precision is Precision.FP16:
            if major < 11:
                return src, {"fp16": {"mode": "BuilderFlag.FP16 on the fp32 ONNX (TensorRT picks fp16 kernels)"}}
            from services.exporters.onnxruntime import to_fp16

            ctx.progress("converting the ONNX to fp16 for a strongly typed build (fp32 inputs and outputs kept)")
            dst = work / "model-fp16.onnx"
            to_fp16(src, dst)
            return dst, {"fp16": {"mode": "fp16 ONNX, fp32 I/O kept", "tool": "onnxruntime.transformers.float16"}}
        from services.tensorrt.qdq import make_qdq_model

        feeds, label = calibration_feeds(load_reference(ctx.reference))
        ctx.progress(f"writing symmetric int8 Q/DQ from {len(feeds)} samples ({label})")
        dst = work / "model-qdq.onnx"
        settings = make_qdq_model(src, dst, feeds, work / "scratch")
        return dst, {"int8": {**settings, "calibration_data": label}}
    except ImportError as exc:
        raise EngineUnavailable(
            f"preparing a {precision.value} TensorRT build needs onnxruntime: {exc}",
            hint="The TensorRT worker image installs onnxruntime for Q/DQ quantization and fp16 conversion.",
        ) from exc


def export_tensorrt(ctx: StepContext) -> Artifact:
    """Build model.plan at the job's precision, validated and benchmarked on the GPU."""
    precision = Precision(ctx.step.options.get("precision", ctx.spec.precision.value))
    src = ctx.model.path
    options = ctx.spec.engine_options(TensorRTOptions)
    variant = options.variant
    major = _installed_major() or variant_major(variant)
    ctx.progress(f"pre-flight: checking the model against TensorRT {major}.x's ONNX parser")
    report = require_tensorrt_support(src, tensorrt_major=major)
    profile = derive_profile(load_onnx(src, load_external_data=False), ctx.spec)

    trt = import_tensorrt()  # ENGINE_UNAVAILABLE from here on when this worker has no TensorRT
    major = tensorrt_major(trt)
    build_input, prepared = _prepare(ctx, src, precision, major)
    if build_input != src:
        require_tensorrt_support(build_input, tensorrt_major=major)
    ctx.progress(f"building the TensorRT {trt.__version__} engine ({precision.value})")
    build = build_plan(
        build_input,
        ctx.out_dir / MODEL_FILE,
        BuildOptions(
            precision=precision,
            profiles=(profile,),
            workspace_mb=options.workspace_mb,
            cache_dir=get_settings().cache_dir,
        ),
        trt=trt,
    )
    details: dict[str, Any] = {
        "variant": variant,
        "tensorrt_version": build.tensorrt_version,
        "compute_capability": build.compute_capability,
        "profiles": build.profiles,
        "workspace_mb": build.workspace_mb,
        "timing_cache": build.timing_cache,
        "api": build.api,
        "network_flags": build.network_flags,
        "builder_flags": build.builder_flags,
        "build_seconds": build.seconds,
        "preflight": {"tensorrt": report.tensorrt, "nodes": report.nodes, "warnings": report.warnings},
        **prepared,
    }
    return finish_export(
        ctx,
        fmt=Format.TENSORRT_PLAN,
        entry=MODEL_FILE,
        precision=precision,
        serving=serving_for(profile),
        engine_details=details,
        warnings=calibration_warnings(prepared["int8"]["calibration_data"]) if "int8" in prepared else [],
    )
