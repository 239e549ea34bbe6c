"""Run a serialized TensorRT plan on the GPU, with device buffers managed through cuda-python.

cuda-python is the CUDA binding NVIDIA's own TensorRT samples use since 10.13; it is small
next to torch, which a TensorRT worker image need not carry. The runner deserializes the
plan, and per call sets each input's shape (inside the engine's optimization profile),
copies inputs to device buffers it reuses while they are big enough, enqueues with
``execute_async_v3`` on its own stream and copies the outputs back. Both TensorRT 10.x and
11.x expose this name-based tensor API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from services.errors import ConversionFailed, EngineUnavailable, InvalidSpec, SourceUnreadable
from services.runners.base import ModelRunner, TensorSpec, contiguous

__all__ = ["TensorRTRunner"]


def _import_cudart() -> Any:
    try:
        try:
            from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
        except ImportError:
            from cuda import cudart  # older cuda-python
    except ImportError as exc:
        raise EngineUnavailable(
            f"cuda-python is not installed: {exc}",
            hint="pip install cuda-python (it ships with the TensorRT worker image).",
        ) from exc
    return cudart


class TensorRTRunner(ModelRunner):
    """A deserialized TensorRT engine with one execution context and one CUDA stream."""

    def __init__(self, path: Path, *, device: int = 0, **_: Any) -> None:
        from services.tensorrt.builder import import_tensorrt

        trt = import_tensorrt()
        self._trt = trt
        self._cudart = _import_cudart()
        self._call(self._cudart.cudaSetDevice(device))
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(Path(path).read_bytes())
        if self.engine is None:
            raise SourceUnreadable(
                f"TensorRT cannot load {Path(path).name}",
                hint="A plan only loads with the TensorRT release and GPU architecture that built it; rebuild it here.",
            )
        self.context = self.engine.create_execution_context()
        self.inputs, self.outputs = [], []
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            spec = TensorSpec(
                name,
                self._np_dtype(name).name,
                tuple(d if d >= 0 else None for d in self.engine.get_tensor_shape(name)),
            )
            is_input = self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            (self.inputs if is_input else self.outputs).append(spec)
        self._stream = self._call(self._cudart.cudaStreamCreate())
        self._buffers: dict[str, tuple[int, int]] = {}  # name -> (device pointer, bytes)

    def _call(self, result: Any) -> Any:
        """Unwrap a cuda-python ``(error, *values)`` tuple, raising on a CUDA error."""
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._cudart.cudaError_t.cudaSuccess:
            raise ConversionFailed(f"CUDA call failed: {err}", tool="cuda-python")
        return values[0] if len(values) == 1 else values

    def _np_dtype(self, name: str) -> np.dtype:
        trt_type = self.engine.get_tensor_dtype(name)
        try:
            return np.dtype(self._trt.nptype(trt_type))
        except TypeError as exc:  # BF16 / FP8 I/O have no numpy type
            raise ConversionFailed(
                f"tensor {name} has type {trt_type}, which numpy cannot hold", tool="tensorrt"
            ) from exc

    def _device(self, name: str, nbytes: int) -> int:
        ptr, size = self._buffers.get(name, (0, 0))
        if size < nbytes:
            if ptr:
                self._call(self._cudart.cudaFree(ptr))
            ptr = int(self._call(self._cudart.cudaMalloc(max(nbytes, 1))))
            self._buffers[name] = (ptr, nbytes)
        return ptr

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        cudart = self._cudart
        h2d = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        d2h = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        staged = []  # keep host arrays alive until the stream is synchronised
        for t in self.inputs:
            arr = contiguous(feeds[t.name], dtype=np.dtype(t.dtype))
            if not self.context.set_input_shape(t.name, arr.shape):
                lo, opt, hi = self.engine.get_tensor_profile_shape(t.name, 0)
                raise InvalidSpec(
                    f"input {t.name} of shape {list(arr.shape)} is outside the engine's profile "
                    f"{list(lo)}..{list(hi)} (opt {list(opt)})",
                    hint="Widen inputs.<name>.min/max in the spec and rebuild.",
                )
            ptr = self._device(t.name, arr.nbytes)
            self._call(cudart.cudaMemcpyAsync(ptr, arr, arr.nbytes, h2d, self._stream))
            self.context.set_tensor_address(t.name, ptr)
            staged.append(arr)
        results = {}
        for t in self.outputs:
            shape = tuple(self.context.get_tensor_shape(t.name))
            if any(d < 0 for d in shape):
                raise ConversionFailed(
                    f"output {t.name} has a data-dependent shape {list(shape)}; Kiln's TensorRT runner needs it known after the inputs",
                    tool="tensorrt",
                )
            host = np.empty(shape, dtype=np.dtype(t.dtype))
            ptr = self._device(t.name, host.nbytes)
            self.context.set_tensor_address(t.name, ptr)
            results[t.name] = host
        if not self.context.execute_async_v3(self._stream):
            raise ConversionFailed("TensorRT failed to enqueue the inference", tool="tensorrt")
        for name, host in results.items():
            self._call(cudart.cudaMemcpyAsync(host, self._buffers[name][0], host.nbytes, d2h, self._stream))
        self._call(cudart.cudaStreamSynchronize(self._stream))
        return results

    def close(self) -> None:
        for ptr, _ in self._buffers.values():
            self._cudart.cudaFree(ptr)
        self._buffers.clear()
        if getattr(self, "_stream", None) is not None:
            self._cudart.cudaStreamDestroy(self._stream)
            self._stream = None
        self.context = None
        self.engine = None
