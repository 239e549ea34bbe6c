"""Run ONNX models with ONNX Runtime on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from services.errors import SourceUnreadable
from services.runners.base import InputBound, ModelRunner, TensorSpec

__all__ = ["ORT_DTYPES", "OnnxRuntimeRunner"]

#: ONNX Runtime's type strings -> numpy dtype names.
ORT_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(bfloat16)": "bfloat16",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(int16)": "int16",
    "tensor(uint16)": "uint16",
    "tensor(int32)": "int32",
    "tensor(uint32)": "uint32",
    "tensor(int64)": "int64",
    "tensor(uint64)": "uint64",
    "tensor(bool)": "bool",
    "tensor(string)": "str",
}


def _spec(arg: Any) -> TensorSpec:
    shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in arg.shape)
    return TensorSpec(arg.name, ORT_DTYPES.get(arg.type, arg.type), shape)


class OnnxRuntimeRunner(ModelRunner):
    """An onnxruntime InferenceSession; graph optimisations stay at ORT's default level."""

    def __init__(self, path: Path, *, threads: int | None = None, optimization: str | None = None, **_: Any) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        if optimization == "disable":
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        elif optimization == "basic":
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.log_severity_level = 3
        self.path = Path(path)
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own exception types for bad graphs
            raise SourceUnreadable(f"onnxruntime cannot load {Path(path).name}: {exc}") from exc
        self.inputs = [_spec(a) for a in self.session.get_inputs()]
        self.outputs = [_spec(a) for a in self.session.get_outputs()]

    def input_bounds(self) -> dict[str, InputBound]:
        from services.runners.onnx_bounds import onnx_input_bounds

        return onnx_input_bounds(self.path)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [o.name for o in self.outputs]
        values = self.session.run(names, feeds)
        return dict(zip(names, values, strict=True))
