"""TensorRT target internals: parser pre-flight, optimization profiles, Q/DQ int8, plan builder.

Nothing here imports ``tensorrt`` at module level: the pre-flight, profiles and Q/DQ run on
any machine; only :mod:`services.tensorrt.builder` (and the runner) need TensorRT and a GPU.
"""

from services.tensorrt.preflight import PreflightReport, preflight, require_tensorrt_support
from services.tensorrt.profiles import InputProfile, ShapeProfile, derive_profile

__all__ = [
    "InputProfile",
    "PreflightReport",
    "ShapeProfile",
    "derive_profile",
    "preflight",
    "require_tensorrt_support",
]
