"""CUDA's shared libraries as PyPI wheels install them, loaded before TVM looks for them.

NVIDIA's CUDA 13 wheels put ``libcudart.so.13`` under ``site-packages/nvidia/cu13/lib`` (CUDA 12's
under ``nvidia/cuda_runtime/lib``), which the dynamic loader does not search; onnxruntime-gpu
preloads its own (``onnxruntime.preload_dlls``), TVM does not. TVM's CUDA runtime
(``libtvm_runtime_cuda.so``) needs ``libcudart`` and the driver's ``libcuda.so.1``; when its Python
package skipped it (the runtime-only mode, or libcudart not found at import), it is loaded here.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path
from typing import Any

__all__ = ["load_tvm_cuda_runtime", "preload_cudart"]


def _wheel_libraries(name: str) -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    roots = (spec.submodule_search_locations or []) if spec else []
    found: list[Path] = []
    for root in roots:
        found += sorted(Path(root).glob(f"*/lib/{name}"), reverse=True)
    return found


def preload_cudart() -> str | None:
    """Load ``libcudart.so.13`` globally from the CUDA runtime wheel when there is one; return its path."""
    for path in _wheel_libraries("libcudart.so.13"):
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            return str(path)
        except OSError:
            continue
    return None


def load_tvm_cuda_runtime(tvm: Any) -> None:
    """Make sure TVM's CUDA runtime is registered (it loads CUDA modules: ``ffi.Module.load_from_bytes.cuda``)."""
    import tvm_ffi

    if tvm_ffi.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None:
        return
    lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_LOCAL)  # OSError names the library it could not find
