"""Versions of the tools each engine's steps use: part of cache keys and of every manifest."""

from __future__ import annotations

import platform
from functools import cache
from importlib import metadata

import services

__all__ = ["ENGINE_PACKAGES", "tool_versions"]

#: Distributions whose version changes what an engine's steps produce.
ENGINE_PACKAGES: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("onnx", "onnxruntime", "onnxscript", "onnx-ir", "onnxslim", "torch", "numpy"),
    "openvino": ("onnx", "openvino", "nncf", "numpy"),
    "tensorflow": ("tensorflow", "keras", "tf2onnx", "onnx2tf", "ai-edge-litert", "onnx", "numpy"),
    "tensorrt": ("tensorrt", "cuda-python", "onnxruntime", "onnx", "numpy"),
    "tvm": ("apache-tvm", "apache-tvm-ffi", "onnx", "numpy"),
}


@cache
def tool_versions(engine: str) -> dict[str, str]:
    """Return installed versions of the engine's tools (absent ones omitted), plus Kiln's and Python's."""
    family = "tensorrt" if engine.startswith("tensorrt") else engine
    out = {"kiln": services.__version__, "python": platform.python_version()}
    for dist in ENGINE_PACKAGES.get(family, ()):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    if family == "tvm":  # its libraries are compiled for the host CPU: another CPU needs its own build
        from services.tvm.host import cpu_fingerprint

        out["host_cpu"] = cpu_fingerprint()
    return out
