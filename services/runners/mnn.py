"""Run ``.mnn`` models with MNN's Python API (``MNN.nn`` modules on the CPU backend).

Only ``MNN`` itself is imported, never ``MNN.tools``: that package's logger pip-installs an
SDK and reports usage with the machine id on import (see services/exporters/mnn_tool.py).

An ``.mnn`` file stores each input's dims with open axes set to 1, and no output shapes or
dtypes; MNN resizes its graph to whatever it is fed. The exporter therefore passes the ONNX
model's own signature (``tensor_specs``), so parity, the benchmark's batch sizes and the
manifest's ``io`` see the open axes the source declared.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from services.errors import SourceUnreadable
from services.runners.base import ModelRunner, TensorSpec, contiguous

__all__ = ["MNN_PRECISIONS", "MnnRunner"]

#: MNN's CPU precision modes. "high" computes in fp32 throughout; "low" lets a CPU with fp16
#: (or bf16) arithmetic use it, and falls back to fp32 on one without (x86 without AVX512-FP16).
MNN_PRECISIONS = ("high", "normal", "low")

#: MNN dtype names (``Var.dtype``) -> numpy dtype names.
_MNN_DTYPES = {
    "float": "float32",
    "double": "float64",
    "int": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "int8": "int8",
}


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _dtype_name(var: Any) -> str:
    return _MNN_DTYPES.get(str(var.dtype).rsplit(".", 1)[-1], "float32")


class MnnRunner(ModelRunner):
    """An ``MNN.nn`` module loaded from a ``.mnn`` file, run on MNN's CPU backend."""

    def __init__(
        self,
        path: Path,
        *,
        precision: str = "high",
        threads: int | None = None,
        tensor_specs: dict[str, list[dict[str, Any]]] | None = None,
        **_: Any,
    ) -> None:
        import MNN

        if precision not in MNN_PRECISIONS:
            raise ValueError(f"MNN precision {precision!r} is not one of {MNN_PRECISIONS}")
        self._mnn = MNN
        self.precision = precision
        self.threads = threads or _default_threads()
        path = Path(path)
        config = {"backend": "CPU", "precision": precision, "numThread": self.threads}
        try:
            self._runtime = MNN.nn.create_runtime_manager((config,))
            probe = MNN.nn.load_module_from_file(str(path), [], [])
            info = probe.get_info()
            # rearrange: weights are packed into the CPU kernels' layout once, at load. Measured on a
            # ResNet-like CNN, one thread: 0.78x the CPU time per run, outputs equal to 6e-8. It also
            # picks other convolution kernels: PP-OCRv4 det's fp32 map is 1.6e-5 (of its maximum) from
            # the source with it, 1.75e-3 without (MNN's default), so the published README says so.
            self.module = MNN.nn.load_module_from_file(
                str(path),
                list(info["inputNames"]),
                list(info["outputNames"]),
                runtime_manager=self._runtime,
                rearrange=True,
            )
        except Exception as exc:  # MNN raises plain exceptions (or returns None) for bad files
            raise SourceUnreadable(f"MNN cannot load {path.name}: {exc}") from exc
        if self.module is None:
            raise SourceUnreadable(f"MNN cannot load {path.name}: not an MNN model")
        self.version = str(info.get("version", ""))
        stored = [
            TensorSpec(name, _dtype_name(var), tuple(d if d > 0 else None for d in var.shape))
            for name, var in zip(info["inputNames"], info["inputs"], strict=False)
        ]
        if tensor_specs:
            self.inputs = [TensorSpec.from_dict(t) for t in tensor_specs["inputs"]]
            self.outputs = [TensorSpec.from_dict(t) for t in tensor_specs["outputs"]]
            if [t.name for t in self.inputs] != list(info["inputNames"]) or [t.name for t in self.outputs] != list(
                info["outputNames"]
            ):
                raise SourceUnreadable(
                    f"{path.name} takes {info['inputNames']} and gives {info['outputNames']}, not the source's "
                    f"{[t.name for t in self.inputs]} -> {[t.name for t in self.outputs]}"
                )
        else:
            self.inputs = stored or [TensorSpec(n, "float32", ()) for n in info["inputNames"]]
            self.outputs = [TensorSpec(n, "float32", ()) for n in info["outputNames"]]
        self._formats = {name: var.data_format for name, var in zip(info["inputNames"], info["inputs"], strict=False)}

    def _var(self, spec: TensorSpec, value: np.ndarray) -> Any:
        expr = self._mnn.expr
        arr = contiguous(value)
        if arr.dtype.kind == "f":
            arr, dtype = arr.astype(np.float32, copy=False), expr.float
        elif arr.dtype.kind in "iub":
            # MNN computes integer tensors (token ids, indices) as int32.
            arr, dtype = arr.astype(np.int32, copy=False), expr.int
        else:
            raise ValueError(f"MNN cannot take {arr.dtype} for input {spec.name}")
        layout = self._formats.get(spec.name, expr.NCHW)
        if layout == expr.NC4HW4:  # Caffe models take channel-packed tensors: pack a plain NCHW array
            return expr.convert(expr.const(arr, list(arr.shape), expr.NCHW, dtype), expr.NC4HW4)
        return expr.const(arr, list(arr.shape), layout, dtype)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        expr = self._mnn.expr
        values = self.module.forward([self._var(t, feeds[t.name]) for t in self.inputs])
        if len(values) != len(self.outputs):
            # MNN reports a failed forward only on stderr ("code=2 in onForward") and returns fewer values.
            raise RuntimeError(
                f"MNN's forward gave {len(values)} of the model's {len(self.outputs)} outputs "
                "(the engine could not run this graph; its log has the code)"
            )
        out = {}
        for spec, var in zip(self.outputs, values, strict=True):
            # Convolutions leave NC4HW4 tensors; convert back to the graph's own layout.
            if var.data_format == expr.NC4HW4:
                var = expr.convert(var, expr.NCHW)
            arr = np.array(var.read(), copy=True)
            want = np.dtype(spec.dtype) if spec.dtype not in ("str", "bfloat16") else arr.dtype
            out[spec.name] = arr.astype(want, copy=False)
        return out

    def close(self) -> None:
        self.module = None
        self._runtime = None
