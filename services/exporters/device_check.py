"""The ``check:<target>`` step: a GPU-bound artifact's parity and benchmark, run again on the GPU that serves it.

Runs on the GPU worker (queue kiln.gpu-<variant>) between a target's export and its publish
(services/graph/device_checks.py plans it). Its input is the export's artifact, already checked on
the CPU; this step loads it on the GPU, checks it against the same reference outputs, times it,
and hands the same files on with a ``device_check`` record naming the GPU (name, compute
capability, memory, driver, CUDA version) and its numbers, and without the export's "checked on
the CPU only" warning. An artifact that disagrees with the source on its GPU fails here with
PARITY_FAILED, so it is never published as verified.

- onnxruntime (``serving.onnxruntime_device: gpu``): onnxruntime's CUDA execution provider at the
  artifact's precision (fp32, fp16: the model as exported); its parity and benchmark become the
  target's, since Triton serves it there; the CPU's stay in the record. Where the image has
  TensorRT, its execution provider is checked and timed too (reported; not a gate).
- tvm (``options.tvm.cuda_arch``): ``model_cuda.so`` on TVM's CUDA runtime, with its load time
  (its kernels are embedded cubins: services/tvm/cuda.py); the target's own parity stays the CPU
  library's (``model.so`` is the version's main library).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.artifacts import DESCRIPTOR, Artifact
from services.errors import EngineUnavailable, KilnError
from services.exporters._common import benchmark_alone, check_artifact_parity
from services.formats import Format
from services.gpu.device import GpuDevice, require_gpu
from services.runners import ModelRunner
from services.spec import Precision
from services.steps.context import StepContext
from services.steps.reference import ReferenceData, load_reference

__all__ = ["CPU_ONLY_PREFIX", "run_device_check"]

#: How the export's warning begins (services/graph/device_checks.py:cpu_only_warning); a GPU check drops it.
CPU_ONLY_PREFIX = "checked on the CPU only:"

#: A model loaded on the GPU: (the runner, what runs it, seconds to load).
Loaded = tuple[ModelRunner, str, float]


def _copy_artifact(src: Path, dst: Path) -> None:
    """Hand the export's files on unchanged: hard links where the store allows, else copies."""
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        if rel.name == DESCRIPTOR:
            continue
        out = dst / rel
        if path.is_dir():
            out.mkdir(parents=True, exist_ok=True)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, out)
        except OSError:
            shutil.copy2(path, out)


def _timed(open_runner: Callable[[], ModelRunner]) -> tuple[ModelRunner, float]:
    started = time.perf_counter()
    runner = open_runner()
    return runner, time.perf_counter() - started


def _onnxruntime_on(provider: str, path: Path) -> Loaded:
    import onnxruntime

    from services.runners.onnx import OnnxRuntimeRunner

    runner, seconds = _timed(lambda: OnnxRuntimeRunner(path, providers=[provider, "CPUExecutionProvider"]))
    return runner, f"onnxruntime {onnxruntime.__version__} {provider}", seconds


def _tvm_cuda(path: Path) -> Loaded:
    from services.gpu.libraries import load_tvm_cuda_runtime, preload_cudart
    from services.runners.tvm import TvmRunner
    from services.tvm import import_tvm

    preload_cudart()
    load_tvm_cuda_runtime(import_tvm())
    runner, seconds = _timed(lambda: TvmRunner(path, device="cuda"))
    return runner, "tvm CUDA runtime", seconds


def _measure(
    ctx: StepContext, ref: ReferenceData, precision: Precision, loaded: Loaded, fmt: Format, artifact: Path
) -> dict[str, Any]:
    """Return one runtime's record on the GPU: what ran, load time, parity, benchmark (PARITY_FAILED raises)."""
    runner, runtime, seconds = loaded
    try:
        ctx.progress(f"on the GPU with {runtime} (loaded in {seconds * 1000:.0f} ms)")
        parity, fixed = check_artifact_parity(ctx, runner, ref, precision, fmt=fmt, artifact=artifact)
        bench: list[dict[str, Any]] = []
        busy = None
        if ctx.spec.bench.enabled:
            bench, busy = benchmark_alone(ctx, runner)
    finally:
        runner.close()
    return {
        "runtime": runtime,
        "load_ms": round(seconds * 1000, 2),
        "parity": parity.to_dict(),
        "benchmark": bench,
        "warnings": [w for w in (fixed, busy) if w],
    }


def _check_onnxruntime(
    ctx: StepContext, ref: ReferenceData, precision: Precision, folder: Path, meta: dict[str, Any]
) -> dict[str, Any]:
    import onnxruntime

    model = folder / str(meta.get("entry") or "model.onnx")
    record = _measure(ctx, ref, precision, _onnxruntime_on("CUDAExecutionProvider", model), Format.ONNX, model)
    # Triton serves it on the GPU: the target's parity and benchmark are the GPU's from here on.
    record["cpu"] = {"parity": meta.get("parity"), "benchmark": meta.get("benchmark"), "vs_fp32": meta.get("vs_fp32")}
    meta["parity"], meta["benchmark"], meta["vs_fp32"] = record["parity"], record["benchmark"], None
    if "TensorrtExecutionProvider" in onnxruntime.get_available_providers():
        # Reported beside the CUDA provider's numbers, not a gate: Triton's default for onnxruntime is CUDA.
        try:
            trt = _measure(ctx, ref, precision, _onnxruntime_on("TensorrtExecutionProvider", model), Format.ONNX, model)
        except KilnError as exc:
            trt = {"runtime": "onnxruntime TensorrtExecutionProvider", "error": exc.to_dict()}
        record["also"] = [trt]
    return record


def _check_tvm(
    ctx: StepContext, ref: ReferenceData, precision: Precision, folder: Path, meta: dict[str, Any]
) -> dict[str, Any]:
    from services.tvm import CUDA_LIBRARY

    library = folder / CUDA_LIBRARY
    if not library.is_file():
        raise EngineUnavailable(f"the tvm artifact has no {CUDA_LIBRARY} to check on the GPU")
    # The version's main library is model.so, checked on the CPU by the export: its numbers stay the target's.
    return _measure(ctx, ref, precision, _tvm_cuda(library), Format("tvm_library"), library)


#: target -> how its artifact runs on a GPU.
_CHECKS: dict[str, Callable[[StepContext, ReferenceData, Precision, Path, dict[str, Any]], dict[str, Any]]] = {
    "onnxruntime": _check_onnxruntime,
    "tvm": _check_tvm,
}


def device_record(gpu: GpuDevice, record: dict[str, Any], bound: str | None) -> dict[str, Any]:
    """Return the ``device_check`` a version's manifest and the job carry: the GPU, then the numbers."""
    return {"checked_on": "gpu", "device": gpu.to_dict(), "device_bound": bound, **record}


def run_device_check(ctx: StepContext) -> Artifact:
    """Run the exported artifact on this worker's GPU: parity against the reference, benchmark; hand it on."""
    target = ctx.step.target or ""
    try:
        gpu = require_gpu()  # before anything is loaded
    except EngineUnavailable as exc:
        exc.message = f"{target} must be checked on a GPU ({ctx.step.options.get('device_bound')}), but {exc.message}"
        exc.args = (exc.message,)
        raise
    check = _CHECKS.get(target)
    if check is None:
        raise EngineUnavailable(f"Kiln has no GPU check for the {target} target", hint="Known: " + ", ".join(_CHECKS))
    exported = ctx.model
    meta = dict(exported.meta)
    meta["entry"] = exported.entry
    precision = Precision(meta.get("precision") or ctx.step.options.get("precision", ctx.spec.precision.value))
    ctx.progress(f"checking {target} on {gpu.name} ({gpu.arch}, {gpu.memory_mib} MiB, driver {gpu.driver})")
    _copy_artifact(exported.root, ctx.out_dir)
    ref = load_reference(ctx.reference)
    record = check(ctx, ref, precision, ctx.out_dir, meta)
    extra = record.pop("warnings", [])
    meta["warnings"] = [w for w in meta.get("warnings", []) if not w.startswith(CPU_ONLY_PREFIX)] + [
        f"on the GPU: {w}" for w in extra
    ]
    meta["device_check"] = device_record(gpu, record, ctx.step.options.get("device_bound"))
    meta.pop("entry", None)
    return Artifact(root=ctx.out_dir, kind=exported.kind, entry=exported.entry, meta=meta)
