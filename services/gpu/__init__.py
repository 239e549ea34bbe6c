"""The NVIDIA GPU a worker runs on: what it is (NVML), and whether the GPU engine can use it."""

from services.gpu.device import GpuDevice, device_versions, gpu_engine_unavailable, probe_gpu

__all__ = ["GpuDevice", "device_versions", "gpu_engine_unavailable", "probe_gpu"]
