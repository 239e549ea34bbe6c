"""Run ONNX models with ONNX Runtime: on the CPU, or on the execution providers a GPU check names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from services.errors import InvalidModel, KilnError, SourceUnreadable, UnsupportedOps
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


def _load_error(path: Path, exc: Exception) -> KilnError:
    """Return why onnxruntime cannot load ``path``, by cause: not a protobuf, an invalid graph, an op it lacks."""
    text = str(exc)
    said = f"onnxruntime cannot load {path.name}: {text}"
    if "NOT_IMPLEMENTED" in text or "Could not find an implementation" in text:
        return UnsupportedOps(
            said,
            hint="onnxruntime does not implement that operator at the model's opset; old opsets are upgraded for "
            "the targets (and the reference taken from OpenVINO or onnx.reference), a newer export avoids it.",
        )
    opset = re.search(r"Opset (\d+) is under development|opset (\d+) .*not supported", text)
    if opset or "Unsupported model IR version" in text:
        import onnxruntime

        return UnsupportedOps(
            said,
            hint=f"The model's opset or IR version is newer than onnxruntime {onnxruntime.__version__} reads; "
            "re-export it at an earlier opset, or target an engine that reads it (openvino).",
        )
    if "INVALID_GRAPH" in text or "ValidationError" in text or "Type Error" in text:
        return InvalidModel(said, hint="The graph is invalid as ONNX; re-export it from its framework.")
    if "INVALID_PROTOBUF" in text or "Protobuf parsing failed" in text:
        return SourceUnreadable(said)  # the default hint: truncated or corrupt
    return SourceUnreadable(said, hint="onnxruntime's message above says what it could not load.")


class OnnxRuntimeRunner(ModelRunner):
    """An onnxruntime InferenceSession, at ORT's default graph optimisation level unless told otherwise.

    Options: ``threads`` (intra-op), ``optimization`` ("disable", "basic", "extended"; else ORT's
    default, all), ``profile_prefix`` (ORT's profiler on, its JSON written at that path prefix;
    :meth:`end_profiling` returns the file), ``providers`` (onnxruntime's execution providers in order of
    preference; default the CPU's: a GPU check names CUDAExecutionProvider, and the first must start, since
    onnxruntime would otherwise fall back to the next one silently).
    """

    def __init__(
        self,
        path: Path,
        *,
        threads: int | None = None,
        optimization: str | None = None,
        profile_prefix: str | None = None,
        providers: list[str] | None = None,
        **_: Any,
    ) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        if optimization == "disable":
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        elif optimization == "basic":
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        elif optimization == "extended":
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        if profile_prefix:
            opts.enable_profiling = True
            opts.profile_file_prefix = profile_prefix
        opts.log_severity_level = 3
        self.path = Path(path)
        wanted = providers or ["CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=wanted)
        except Exception as exc:  # ORT raises its own exception types for bad graphs
            raise _load_error(Path(path), exc) from exc
        if self.session.get_providers()[0] != wanted[0]:
            from services.errors import EngineUnavailable

            raise EngineUnavailable(
                f"onnxruntime {ort.__version__} did not start {wanted[0]} (it runs {self.session.get_providers()}; "
                f"available here: {ort.get_available_providers()})",
                hint="The GPU worker needs onnxruntime-gpu with its CUDA and cuDNN wheels (pip install 'kiln[gpu]') "
                "and a visible GPU; onnxruntime's log says which library it could not load.",
            )
        self.inputs = [_spec(a) for a in self.session.get_inputs()]
        self.outputs = [_spec(a) for a in self.session.get_outputs()]

    def input_bounds(self) -> dict[str, InputBound]:
        from services.runners.onnx_bounds import onnx_input_bounds

        return onnx_input_bounds(self.path)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [o.name for o in self.outputs]
        values = self.session.run(names, feeds)
        return dict(zip(names, values, strict=True))

    def end_profiling(self) -> Path:
        """Return the profile JSON ORT wrote (profiling must have been on: ``profile_prefix``)."""
        return Path(self.session.end_profiling())
