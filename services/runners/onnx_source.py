"""Run an ONNX *source* for the reference: onnxruntime, else ONNX's own reference evaluator, else OpenVINO.

The reference must come from a runtime that can run the model as it was given. onnxruntime no
longer implements some operators of old opsets (``AveragePool(1)``, ``Add(6)``: measured on 34
of ONNX's own backend test models). ``onnx.reference.ReferenceEvaluator`` is the
specification's own implementation, slow but exact (float64 stays float64): it comes next
for graphs small enough to run in it. OpenVINO reads old opsets as they are and runs large
graphs fast, but computes in float32 (measured on the backend data's double-precision cases:
values of 1e198 became infinities), so it comes last. Each is tried in turn, at load
and on the first run; the one that ran is recorded (``runtime``), with why the others did not
(``passed_over``).

When none can run it, the error says why by cause, not "truncated or corrupt": a file that is
not an ONNX protobuf (SOURCE_UNREADABLE), a graph ONNX's checker refuses (INVALID_MODEL), an
operator or opset no runtime here implements (UNSUPPORTED_OPS), or the engines' own words.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from services.errors import ConversionFailed, InvalidModel, KilnError, SourceUnreadable, UnsupportedOps
from services.runners.base import InputBound, ModelRunner, TensorSpec

__all__ = ["OnnxReferenceRunner", "OnnxSourceRunner", "onnx_load_error"]

#: onnx.reference runs graphs up to this many nodes and weight bytes (pure Python and numpy:
#: larger ones take minutes per sample).
REFERENCE_MAX_NODES = 3000
REFERENCE_MAX_WEIGHT_BYTES = 64 << 20

_NOT_IMPLEMENTED = re.compile(r"Could not find an implementation for (\w+)\((\d+)\)")


class OnnxReferenceRunner(ModelRunner):
    """``onnx.reference.ReferenceEvaluator`` behind the runner interface (the specification's implementation)."""

    def __init__(self, path: Path, **_: Any) -> None:
        import onnx
        from onnx.reference import ReferenceEvaluator

        header = onnx.load(str(path), load_external_data=False)
        weights = sum(len(t.raw_data) or t.ByteSize() for t in header.graph.initializer)
        if len(header.graph.node) > REFERENCE_MAX_NODES or weights > REFERENCE_MAX_WEIGHT_BYTES:
            raise ConversionFailed(
                f"onnx.reference runs graphs of up to {REFERENCE_MAX_NODES} nodes and "
                f"{REFERENCE_MAX_WEIGHT_BYTES >> 20} MiB of weights; this one has {len(header.graph.node)} and "
                f"{weights >> 20} MiB",
                tool="onnx.reference",
            )
        model = onnx.load(str(path))
        self.evaluator = ReferenceEvaluator(model)
        init = {i.name for i in model.graph.initializer}
        self.inputs = [_spec(v) for v in model.graph.input if v.name not in init]
        self.outputs = [_spec(v) for v in model.graph.output]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [o.name for o in self.outputs]
        values = self.evaluator.run(None, feeds)
        return {n: np.asarray(v) for n, v in zip(names, values, strict=True)}


def _spec(value_info: Any) -> TensorSpec:
    from onnx import helper

    t = value_info.type.tensor_type
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).name
    except Exception:
        dtype = "float32"
    shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
    return TensorSpec(value_info.name, dtype, shape)


def onnx_load_error(path: Path, errors: dict[str, str]) -> KilnError:
    """Return the error for an ONNX file no runtime here could run, by its cause (see the module docstring)."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        return SourceUnreadable(f"{Path(path).name} is not a readable ONNX model: {str(exc)[:300]}")
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=None)
    missing = sorted({f"{m.group(1)}({m.group(2)})" for e in errors.values() for m in _NOT_IMPLEMENTED.finditer(e)})
    said = "; ".join(f"{k}: {v.strip().splitlines()[0][:240] if v.strip() else '?'}" for k, v in errors.items())
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        unknown = re.search(r"No Op registered for (\w+) with domain_version of (\d+)", str(exc))
        if unknown:
            return UnsupportedOps(
                f"{unknown.group(1)} is not an operator of ONNX opset {unknown.group(2)} (no runtime here runs "
                f"{Path(path).name}): {said}",
                hint="Export the model with standard ONNX operators at a released opset; a custom operator needs "
                "its own domain, which Kiln refuses (it would run code).",
                ops=[unknown.group(1)],
                opset=opset,
            )
        return InvalidModel(
            f"{Path(path).name} is an ONNX model whose graph ONNX's checker refuses: {str(exc).strip()[:400]}",
            hint="Re-export the model from its framework; the checker's message names the node or field at fault.",
            runtimes=errors,
        )
    if missing:
        return UnsupportedOps(
            f"no runtime here runs {Path(path).name} (opset {opset}): onnxruntime lacks {', '.join(missing)}; {said}",
            hint="Re-export at a newer opset, or target openvino, which reads most old opsets as they are.",
            ops=missing,
            opset=opset,
        )
    return ConversionFailed(
        f"no runtime here runs {Path(path).name} (opset {opset}): {said}",
        hint="Each runtime's own message is above; the model may use an operator or type none of them supports.",
        tool="onnxruntime, OpenVINO, onnx.reference",
        runtimes=errors,
    )


class OnnxSourceRunner(ModelRunner):
    """The first runtime that loads and runs the ONNX source: onnxruntime, OpenVINO, onnx.reference."""

    def __init__(self, path: Path, **options: Any) -> None:
        from services.runners.onnx import OnnxRuntimeRunner
        from services.runners.openvino import OpenVINORunner

        self.path = Path(path)
        self._factories: list[tuple[str, Callable[[], ModelRunner]]] = [
            ("onnxruntime", lambda: OnnxRuntimeRunner(self.path, **options)),
            ("onnx.reference", lambda: OnnxReferenceRunner(self.path)),
            ("OpenVINO", lambda: OpenVINORunner(self.path)),
        ]
        self.passed_over: dict[str, str] = {}
        self._ran = False
        self._open_next()

    def _open_next(self) -> None:
        while self._factories:
            name, factory = self._factories.pop(0)
            try:
                self._runner = factory()
            except Exception as exc:
                self.passed_over[name] = f"{type(exc).__name__}: {exc}"
                continue
            self.runtime = name
            self.inputs = self._runner.inputs
            self.outputs = self._runner.outputs
            return
        raise onnx_load_error(self.path, self.passed_over)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        while True:
            try:
                out = self._runner.run(feeds)
                self._ran = True
                return out
            except Exception as exc:
                if self._ran:  # it ran the model before: this is about these inputs, not the runtime
                    raise
                self.passed_over[self.runtime] = f"{type(exc).__name__}: {exc}"
                self._runner.close()
                self._open_next()

    def input_bounds(self) -> dict[str, InputBound]:
        from services.runners.onnx_bounds import onnx_input_bounds

        return onnx_input_bounds(self.path)

    def close(self) -> None:
        self._runner.close()
