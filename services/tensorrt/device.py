"""The GPU a TensorRT worker builds for: its compute capability, found without TensorRT.

A plan and a timing cache are only valid on the GPU architecture they were made on, so the
compute capability keys the timing cache and goes into every manifest. Probes, first answer
wins: cuda-python (what the TensorRT runner uses), torch.cuda when torch is installed, then
``nvidia-smi --query-gpu=compute_cap`` (driver only, no Python CUDA package needed).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Callable

__all__ = ["compute_capability", "parse_compute_cap", "sm_tag"]

_CC = re.compile(r"^\s*(\d+)\.(\d+)\s*$")


def parse_compute_cap(text: str) -> str | None:
    """Return "major.minor" from ``nvidia-smi --query-gpu=compute_cap`` output (first GPU listed)."""
    for line in text.splitlines():
        m = _CC.match(line)
        if m:
            return f"{int(m.group(1))}.{int(m.group(2))}"
    return None


def sm_tag(cc: str) -> str:
    """Return the architecture tag of a compute capability: "8.6" → "sm86"."""
    major, _, minor = cc.partition(".")
    return f"sm{int(major)}{int(minor or 0)}"


def _from_cuda_python() -> str | None:
    try:
        try:
            from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
        except ImportError:
            from cuda import cudart  # older cuda-python
    except ImportError:
        return None
    attrs = cudart.cudaDeviceAttr
    err, major = cudart.cudaDeviceGetAttribute(attrs.cudaDevAttrComputeCapabilityMajor, 0)
    if err != cudart.cudaError_t.cudaSuccess:
        return None
    err, minor = cudart.cudaDeviceGetAttribute(attrs.cudaDevAttrComputeCapabilityMinor, 0)
    return f"{major}.{minor}" if err == cudart.cudaError_t.cudaSuccess else None


def _from_torch() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}"


def _from_nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    cmd = [exe, "--query-gpu=compute_cap", "--format=csv,noheader"]
    # nvidia-smi ignores CUDA_VISIBLE_DEVICES; ask for the device CUDA calls 0 when it is an index.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible.isdigit():
        cmd += ["-i", visible]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_compute_cap(proc.stdout) if proc.returncode == 0 else None


_PROBES: tuple[Callable[[], str | None], ...] = (_from_cuda_python, _from_torch, _from_nvidia_smi)


def compute_capability() -> str | None:
    """Return the compute capability ("8.6") of the GPU CUDA calls device 0, or None without a GPU."""
    for probe in _PROBES:
        cc = probe()
        if cc:
            return cc
    return None
