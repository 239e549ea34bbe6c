"""The GPU this process sees, read through NVML (``nvidia-ml-py``): no CUDA context, no GPU memory taken.

NVML is the driver's own management library (``libnvidia-ml.so.1``, mounted into a container by
NVIDIA's container toolkit beside ``libcuda.so.1``), so asking it costs milliseconds and works
before any CUDA library is loaded. Which GPU: the first one ``CUDA_VISIBLE_DEVICES`` names (an
index or a ``GPU-...`` UUID), else the first NVML lists — the one CUDA calls device 0.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

from services.errors import EngineUnavailable

__all__ = ["GpuDevice", "device_versions", "gpu_engine_unavailable", "probe_gpu", "require_gpu"]


@dataclass(frozen=True)
class GpuDevice:
    """One NVIDIA GPU as its driver describes it."""

    name: str  # "NVIDIA H100 80GB HBM3"
    compute_capability: str  # "9.0"
    memory_mib: int
    driver: str  # the NVIDIA driver's version, "580.159.04"
    cuda: str  # the newest CUDA version that driver runs, "13.0"
    uuid: str = ""

    @property
    def arch(self) -> str:
        """Return the CUDA architecture name of its compute capability ("9.0" → "sm_90")."""
        return "sm_" + self.compute_capability.replace(".", "")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "arch": self.arch}

    def versions(self) -> dict[str, str]:
        """Return the device as tool versions (strings): part of the GPU engine's cache keys and manifests."""
        return {
            "gpu": self.name,
            "gpu_compute_capability": self.compute_capability,
            "gpu_memory_mib": str(self.memory_mib),
            "nvidia_driver": self.driver,
            "cuda_driver": self.cuda,
        }

    @classmethod
    def from_versions(cls, versions: dict[str, str]) -> GpuDevice | None:
        """Return the device a worker reported in its tool versions (None when it reported none)."""
        if "gpu_compute_capability" not in versions:
            return None
        try:
            memory = int(versions.get("gpu_memory_mib", "0"))
        except ValueError:
            memory = 0
        return cls(
            name=versions.get("gpu", "?"),
            compute_capability=versions["gpu_compute_capability"],
            memory_mib=memory,
            driver=versions.get("nvidia_driver", "?"),
            cuda=versions.get("cuda_driver", "?"),
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _visible_handle(pynvml: Any) -> Any:
    """Return the NVML handle of the GPU CUDA numbers 0 in this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(visible.encode())
    if visible in ("-1", "none", "NoDevFiles"):
        raise LookupError(f"CUDA_VISIBLE_DEVICES={visible} hides every GPU")
    index = int(visible) if visible.isdigit() else 0
    if pynvml.nvmlDeviceGetCount() <= index:
        raise LookupError("the NVIDIA driver sees no GPU" if index == 0 else f"no GPU {index} (CUDA_VISIBLE_DEVICES)")
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def probe_gpu() -> GpuDevice:
    """Return the GPU this process would compute on; ENGINE_UNAVAILABLE saying why there is none."""
    try:
        import pynvml
    except ImportError as exc:
        raise EngineUnavailable(
            "nvidia-ml-py is not installed, so no GPU can be found",
            hint="Install Kiln's `gpu` extra, or run the GPU worker image (docker/gpu.Dockerfile).",
        ) from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise EngineUnavailable(
            f"no NVIDIA driver here: NVML did not start ({exc})",
            hint="Run on a machine with an NVIDIA GPU and its driver; in a container, with the NVIDIA container "
            "toolkit (compose: `--profile gpu`, Kubernetes: an nvidia.com/gpu resource).",
        ) from exc
    try:
        handle = _visible_handle(pynvml)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        try:
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError:
            uuid = ""
        return GpuDevice(
            name=_text(pynvml.nvmlDeviceGetName(handle)),
            compute_capability=f"{major}.{minor}",
            memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) >> 20,
            driver=_text(pynvml.nvmlSystemGetDriverVersion()),
            cuda=f"{cuda // 1000}.{cuda % 1000 // 10}",
            uuid=uuid,
        )
    except (LookupError, pynvml.NVMLError) as exc:
        raise EngineUnavailable(f"no usable NVIDIA GPU: {exc}") from exc
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def require_gpu() -> GpuDevice:
    """Return the GPU, or ENGINE_UNAVAILABLE: what a step that must run on a GPU calls first."""
    return probe_gpu()


@cache
def gpu_engine_unavailable() -> str | None:
    """Return why the GPU engine cannot run in this process (no driver, no GPU, a CPU-only onnxruntime), or None.

    The GPU engine's descriptor names this as its ``device`` check: a worker serves its queue only
    where it returns None. Cached: a process's GPU does not come and go.
    """
    try:
        probe_gpu()
    except EngineUnavailable as exc:
        return exc.message
    try:
        import onnxruntime
    except ImportError:
        return "onnxruntime is not installed (the GPU worker needs onnxruntime-gpu)"
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return f"onnxruntime {onnxruntime.__version__} here is a CPU build: install onnxruntime-gpu"
    return None


def device_versions() -> dict[str, str]:
    """Return the GPU as tool versions for the GPU engine (its descriptor's ``extra_versions``).

    A check's result depends on the GPU it ran on, so the device is part of the check step's cache
    key: a check on an H100 is not reused as one on an L4. Without a GPU: ``{"gpu": "none"}``.
    """
    try:
        return probe_gpu().versions()
    except EngineUnavailable:
        return {"gpu": "none"}
