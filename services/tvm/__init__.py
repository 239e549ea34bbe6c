"""Apache TVM: ONNX → Relax → a native library for the CPU (and, cross-compiled, for CUDA)."""

from services.descriptors.tvm import TvmOptions
from services.tvm._compile import (
    CUDA_LIBRARY,
    IO_FILE,
    LIBRARY,
    PARAMS,
    README,
    build_libraries,
    cpu_target,
    import_tvm,
    onnx_io,
)
from services.tvm.host import cpu_fingerprint

__all__ = [
    "CUDA_LIBRARY",
    "IO_FILE",
    "LIBRARY",
    "PARAMS",
    "README",
    "TvmOptions",
    "build_libraries",
    "cpu_fingerprint",
    "cpu_target",
    "import_tvm",
    "onnx_io",
]
