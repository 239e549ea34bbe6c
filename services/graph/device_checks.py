"""Which targets run on a GPU, and when a plan checks them there (the ``check:<target>`` step).

A target's descriptor says, through ``device_bound``, what of its artifact a spec sends to a GPU:
onnxruntime's model with ``serving.onnxruntime_device: gpu``, TVM's ``model_cuda.so`` with
``options.tvm.cuda_arch``. Such an artifact is exported and checked on the CPU like any other;
when a GPU worker is live (or the spec requires one) the plan adds a step on the GPU engine's queue
that runs parity and the benchmark again on the GPU, between the export and the publish. Without
it, the artifact is published with :func:`cpu_only_warning`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from services import descriptors
from services.descriptors.gpu import GPU_ENGINE, GpuOptions

__all__ = [
    "GPU_ENGINE",
    "cpu_only_warning",
    "device_bound",
    "gpu_engine",
    "onnxruntime_on_gpu",
    "plans_device_checks",
    "tvm_cuda_library",
]


def onnxruntime_on_gpu(spec: Any) -> str | None:
    """The onnxruntime target's ``device_bound``: Triton runs it on the GPU when the spec says so."""
    if spec.serving.onnxruntime_device == "gpu":
        return "onnxruntime's CUDA provider (serving.onnxruntime_device: gpu)"
    return None


def tvm_cuda_library(spec: Any) -> str | None:
    """The tvm target's ``device_bound``: the CUDA library ``options.tvm.cuda_arch`` asks for."""
    options = spec.options_for("tvm")
    arch = getattr(options, "cuda_arch", None)
    return f"model_cuda.so for {arch} (options.tvm.cuda_arch)" if arch else None


def device_bound(target: str, spec: Any) -> str | None:
    """Return what of ``target``'s artifact runs on a GPU with ``spec`` (None: all of it on the CPU)."""
    desc = descriptors.registry().targets.get(target)
    if desc is None or desc.device_bound is None:
        return None
    from services.graph.registry import load_entry

    return load_entry(desc.device_bound)(spec)  # type: ignore[no-any-return]


def gpu_engine(spec: Any) -> str:
    """Return the concrete GPU engine the spec's ``options.gpu.variant`` picks ("gpu-cu13")."""
    options = spec.options_for(GPU_ENGINE) if spec is not None else None
    variant = getattr(options, "variant", None) or GpuOptions().variant
    return f"{GPU_ENGINE}-{variant}"


def plans_device_checks(spec: Any, live_engines: Collection[str] | None) -> bool:
    """Return True when a plan checks GPU-bound targets on a GPU: one is required, or its worker is live."""
    return bool(spec.require_device_check) or (live_engines is not None and gpu_engine(spec) in live_engines)


def cpu_only_warning(target: str, spec: Any, bound: str) -> str:
    """Return the warning a GPU-bound artifact checked on the CPU alone carries (manifest, job, summary)."""
    queue = f"kiln.{gpu_engine(spec)}"
    return (
        f"checked on the CPU only: {target} runs on a GPU through {bound}, but no GPU worker (queue {queue}) "
        "was live to check it there, so parity and the benchmark are the CPU's; start one (`docker compose "
        '--profile gpu`, the chart\'s workers.gpu-cu13) or set "require_device_check": true to refuse this'
    )
