"""Versions of the tools each engine's steps use: part of cache keys and of every manifest."""

from __future__ import annotations

import platform
from functools import cache
from importlib import metadata

import services

__all__ = ["ENGINE_PACKAGES", "tool_versions"]

#: Distributions whose version changes what an engine's steps produce.
ENGINE_PACKAGES: dict[str, tuple[str, ...]] = {
    "onnxruntime": (
        "onnx",
        "onnxruntime",
        "onnxscript",
        "onnx-ir",
        "onnxslim",
        "torch",
        "numpy",
        "opencv-python-headless",
        "mindspore",
    ),
    "openvino": ("onnx", "openvino", "nncf", "numpy"),
    "tensorflow": ("tensorflow", "keras", "tf2onnx", "onnx2tf", "ai-edge-litert", "onnx", "numpy"),
    "tensorrt": ("tensorrt", "cuda-python", "onnxruntime", "onnx", "numpy"),
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
    return out
