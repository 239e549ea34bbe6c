"""Run OpenVINO IR (model.xml + model.bin) with the OpenVINO runtime on the CPU.

Parity needs the artifact's own numbers, not the CPU's execution shortcuts: on CPUs with
AVX512-BF16/AMX the CPU plugin runs float graphs in bf16 unless told otherwise, which alone
costs about three significant digits. So the runner compiles with
``INFERENCE_PRECISION_HINT=f32`` by default, for every artifact precision:

- fp32 artifacts: f32 execution is the only way to see the conversion's own error.
- fp16 artifacts hold fp16-*compressed weights*; the CPU plugin decompresses them to the
  inference precision at compile time. With f32 the check measures exactly what the
  artifact lost (weight rounding), and its latency is comparable with the fp32 artifact's
  because both run alike. bf16 execution would add the runtime's rounding on top and make
  fp16 look faster than fp32 for a reason the artifact has nothing to do with.
- int8 artifacts: quantised ops run in int8 whatever the hint; the hint only decides the
  ops NNCF left in float, so f32 isolates the quantisation's cost.

``inference_precision="default"`` compiles with the engine's own choice (what OVMS and
Triton do unless configured), for benchmarks that want the deployed speed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from services.errors import InvalidSpec, SourceUnreadable
from services.runners.base import ModelRunner, TensorSpec, contiguous

__all__ = ["OV_DTYPES", "OpenVINORunner", "ov_tensor_spec"]

#: OpenVINO element type names -> numpy dtype names (bf16 has no numpy dtype; named as such).
OV_DTYPES = {
    "f32": "float32",
    "f16": "float16",
    "f64": "float64",
    "bf16": "bfloat16",
    "i8": "int8",
    "u8": "uint8",
    "i16": "int16",
    "u16": "uint16",
    "i32": "int32",
    "u32": "uint32",
    "i64": "int64",
    "u64": "uint64",
    "boolean": "bool",
    "string": "str",
}

#: Values accepted for ``inference_precision``; "default" leaves the plugin's own choice.
_PRECISION_HINTS = ("f32", "bf16", "f16", "default")


def _port_name(port: Any, fallback: str) -> str:
    # A port may carry several tensor names (converters keep aliases); sorted() makes the pick
    # stable across runs. Ports with no name at all (some TF graphs) fall back to the node's
    # friendly name, then to their position.
    names = sorted(port.get_names())
    node = port.get_node()
    friendly = str(node.get_friendly_name()) if node is not None else ""
    # An input's Parameter keeps the source's input name as its friendly name; its port can
    # also carry an exporter's intermediate alias that sorts first ("/lm/.../Reshape_output_0"
    # before "input_ids"), which would reach config.pbtxt as the input's name.
    if friendly and friendly in names and node.get_type_name() == "Parameter":
        return friendly
    if names:
        return str(names[0])
    return friendly or fallback


def ov_tensor_spec(port: Any, fallback: str) -> TensorSpec:
    """Return the TensorSpec of an OpenVINO model port (dynamic dims as None)."""
    pshape = port.get_partial_shape()
    if pshape.rank.is_dynamic:
        shape: tuple[int | None, ...] = ()
    else:
        shape = tuple(d.get_length() if d.is_static else None for d in pshape)
    etype = port.get_element_type().get_type_name()
    return TensorSpec(_port_name(port, fallback), OV_DTYPES.get(etype, etype), shape)


class OpenVINORunner(ModelRunner):
    """An OpenVINO CompiledModel on the CPU with one reusable infer request.

    Options: ``inference_precision`` ("f32" by default, see the module docstring),
    ``shapes`` ({input name: concrete shape}) to reshape dynamic inputs to static ones
    before compiling (static graphs let the CPU plugin pick kernels once), ``threads``,
    ``performance_hint`` ("LATENCY" or "THROUGHPUT"), ``streams``, ``perf_count`` (per-node
    counters on: :meth:`profiling_info`).
    Without ``shapes`` dynamic axes stay dynamic: the CPU plugin runs them as they come.
    """

    def __init__(
        self,
        path: Path,
        *,
        inference_precision: str = "f32",
        shapes: Mapping[str, Sequence[int]] | None = None,
        threads: int | None = None,
        device: str = "CPU",
        performance_hint: str | None = None,
        streams: int | None = None,
        perf_count: bool = False,
        **_: Any,
    ) -> None:
        import openvino as ov

        if inference_precision not in _PRECISION_HINTS:
            raise InvalidSpec(
                f"unknown OpenVINO inference precision {inference_precision!r}",
                hint="Use one of: " + ", ".join(_PRECISION_HINTS) + ".",
            )
        path = Path(path)
        self.core = ov.Core()
        try:
            model = self.core.read_model(str(path))
        except Exception as exc:  # OpenVINO raises RuntimeError subclasses for bad IR
            raise SourceUnreadable(
                f"OpenVINO cannot read {path.name}: {exc}",
                hint="An IR is model.xml with its model.bin beside it; both must come from the same save.",
            ) from exc
        if shapes:
            model = self._reshape(model, shapes)
        config: dict[str, Any] = {}
        if inference_precision != "default":
            config["INFERENCE_PRECISION_HINT"] = inference_precision
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        if performance_hint:
            config["PERFORMANCE_HINT"] = performance_hint
        if streams:
            config["NUM_STREAMS"] = streams
        if perf_count:
            config["PERF_COUNT"] = True
        try:
            self.compiled = self.core.compile_model(model, device, config)
        except Exception as exc:
            raise SourceUnreadable(f"OpenVINO cannot compile {path.name} for {device}: {exc}") from exc
        # What the plugin actually chose ("bf16" on AMX CPUs under "default"), for the report.
        self.inference_precision = self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        self.inputs = [ov_tensor_spec(p, f"input_{i}") for i, p in enumerate(self.compiled.inputs)]
        self.outputs = [ov_tensor_spec(p, f"output_{i}") for i, p in enumerate(self.compiled.outputs)]
        self._in_ports = {t.name: i for i, t in enumerate(self.inputs)}
        self._request = self.compiled.create_infer_request()

    def _reshape(self, model: Any, shapes: Mapping[str, Sequence[int]]) -> Any:
        names = {_port_name(p, f"input_{i}"): p for i, p in enumerate(model.inputs)}
        unknown = sorted(set(shapes) - set(names))
        if unknown:
            raise InvalidSpec(
                f"cannot reshape unknown inputs {unknown}", hint=f"The model's inputs are {sorted(names)}."
            )
        try:
            model.reshape({names[n]: list(s) for n, s in shapes.items()})
        except Exception as exc:  # shape inference refuses incompatible shapes
            raise InvalidSpec(f"OpenVINO cannot reshape the model to {dict(shapes)}: {exc}") from exc
        return model

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if set(feeds) != set(self._in_ports):
            raise InvalidSpec(
                f"feeds {sorted(feeds)} do not match the model's inputs {sorted(self._in_ports)}",
                hint="Key every input by the name the model declares.",
            )
        # Ports are addressed by index: names are ours (fallbacks included), not OpenVINO's.
        request_inputs = {self._in_ports[name]: contiguous(arr) for name, arr in feeds.items()}
        # share_outputs=False (the default) copies results out of the request's buffers,
        # which the next run would overwrite.
        result = self._request.infer(request_inputs)
        return {t.name: np.asarray(result[port]) for t, port in zip(self.outputs, self.compiled.outputs, strict=True)}

    def profiling_info(self) -> list[Any]:
        """Return the last inference's per-node counters (``perf_count`` must have been on)."""
        return list(self._request.profiling_info)

    def close(self) -> None:
        # Dropping the references releases the compiled model's memory and threads.
        self._request = None
        self.compiled = None
