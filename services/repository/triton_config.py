"""Triton's config.pbtxt, built as Triton's own ``ModelConfig`` message and printed by protobuf.

The message class comes from tritonclient's generated ``model_config_pb2`` (a core dependency:
numpy, python-rapidjson and urllib3 only). It is loaded from its file rather than through
``tritonclient.grpc``, whose ``__init__`` imports grpcio, which the worker images lack and
whose pins (grpcio<1.68, protobuf<7) the rest of the lock cannot meet.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from google.protobuf import text_format

from services.errors import KilnError, UnsupportedFormat
from services.spec import TritonServingSpec
from services.tensors import TensorSpec

__all__ = [
    "DEFAULT_MAX_BATCH_SIZE",
    "TRITON_DTYPES",
    "TritonModel",
    "batch_axis_is_dynamic",
    "engine_parameters",
    "model_config_pb2",
    "preferred_batch_sizes",
    "triton_config_pbtxt",
    "triton_model_config",
]

#: Triton's max_batch_size when the spec leaves it unset and every tensor's batch axis is open.
DEFAULT_MAX_BATCH_SIZE = 8

#: numpy dtype name -> Triton DataType enum name.
TRITON_DTYPES = {
    "bool": "TYPE_BOOL",
    "uint8": "TYPE_UINT8",
    "uint16": "TYPE_UINT16",
    "uint32": "TYPE_UINT32",
    "uint64": "TYPE_UINT64",
    "int8": "TYPE_INT8",
    "int16": "TYPE_INT16",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
    "str": "TYPE_STRING",
    "bfloat16": "TYPE_BF16",
}

_MODULE = "tritonclient.grpc.model_config_pb2"


@cache
def model_config_pb2() -> ModuleType:
    """Return Triton's generated ``model_config_pb2`` module (without importing grpcio)."""
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    found = importlib.util.find_spec("tritonclient")
    if found is None or found.origin is None:
        raise KilnError(
            "tritonclient is not installed; Kiln writes Triton's config.pbtxt with its ModelConfig proto",
            hint="pip install tritonclient (a core dependency of kiln).",
        )
    path = Path(found.origin).parent / "grpc" / "model_config_pb2.py"
    spec = importlib.util.spec_from_file_location("kiln_triton_model_config_pb2", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batch_axis_is_dynamic(tensors: list[TensorSpec]) -> bool:
    """Return True when every tensor has a first axis and it is open (Triton may own it)."""
    return bool(tensors) and all(t.shape and t.shape[0] is None for t in tensors)


def preferred_batch_sizes(benchmark: list[dict[str, Any]], max_batch_size: int) -> list[int]:
    """Return the benchmarked batch sizes (>1, within the limit) whose throughput is within 10% of the best.

    Triton's dynamic batcher forms these sizes first when it can; a size Kiln measured as no
    faster per sample than a smaller one would only add queueing delay.
    """
    fits = [b for b in benchmark if 1 < int(b["batch_size"]) <= max_batch_size and b.get("throughput")]
    if not fits:
        return []
    best = max(float(b["throughput"]) for b in fits)
    return sorted(int(b["batch_size"]) for b in fits if float(b["throughput"]) >= 0.9 * best)


#: Kiln's onnxruntime optimisation names -> the onnxruntime backend's optimization.graph.level
#: (onnxruntime_backend's README and src/onnxruntime.cc: -1 basic, 1 extended, 2 disabled; unset: all).
ORT_GRAPH_LEVELS = {"all": None, "extended": 1, "basic": -1, "disable": 2}


def engine_parameters(
    serving: TritonServingSpec, *, platform: str | None, backend: str | None
) -> tuple[dict[str, str], int | None]:
    """Return the backend parameters and graph level that carry ``serving``'s engine settings for this backend.

    Keys are those each backend reads: onnxruntime (platform ``onnxruntime_onnx``)
    ``intra_op_thread_count`` and ``optimization.graph.level``; OpenVINO (backend ``openvino``,
    ModelState::ParseParameters) ``INFERENCE_NUM_THREADS``, ``NUM_STREAMS``, ``PERFORMANCE_HINT``.
    Settings a backend has no key for are left out, never passed as keys it would refuse.
    """
    params: dict[str, str] = {}
    level: int | None = None
    if platform == "onnxruntime_onnx" or backend == "onnxruntime":
        if serving.threads is not None:
            params["intra_op_thread_count"] = str(serving.threads)
        if serving.onnxruntime_optimization is not None:
            level = ORT_GRAPH_LEVELS[serving.onnxruntime_optimization]
    elif backend == "openvino":
        if serving.threads is not None:
            params["INFERENCE_NUM_THREADS"] = str(serving.threads)
        if serving.openvino_streams is not None:
            params["NUM_STREAMS"] = str(serving.openvino_streams)
        if serving.openvino_hint is not None:
            params["PERFORMANCE_HINT"] = serving.openvino_hint
    return params, level


@dataclass
class TritonModel:
    """What Kiln knows about a model that Triton's config needs."""

    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    platform: str | None = None
    backend: str | None = None
    max_batch_size: int = 0
    preferred_batch_sizes: list[int] = field(default_factory=list)
    instance_kind: str = "KIND_CPU"
    default_model_filename: str | None = None
    #: Backend parameters (e.g. OpenVINO's INFERENCE_PRECISION_HINT), as strings.
    parameters: dict[str, str] = field(default_factory=dict)
    #: instance_group count: model instances Triton runs at once.
    instance_count: int = 1
    #: optimization.graph.level (the onnxruntime backend's graph optimisation level); None: unset.
    graph_level: int | None = None


def _fill_tensor(msg: Any, t: TensorSpec, batched: bool) -> None:
    mc = model_config_pb2()
    msg.name = t.name
    if t.dtype not in TRITON_DTYPES:  # a sequence or map of tensors: Triton's tensors cannot carry it
        raise UnsupportedFormat(
            f"{t.name} is of type {t.dtype}, which a Triton model's inputs and outputs cannot carry",
            hint="Triton serves tensors only; export the model with tensor inputs and outputs (a sequence "
            "output as one stacked tensor).",
        )
    msg.data_type = mc.DataType.Value(TRITON_DTYPES[t.dtype])
    dims = list(t.shape[1:] if batched else t.shape)
    if dims:
        msg.dims.extend(d if d is not None else -1 for d in dims)
    else:
        # A scalar: Triton needs at least one dim; reshape maps [1] onto the model's [].
        msg.dims.append(1)
        msg.reshape.SetInParent()


def triton_model_config(model: TritonModel) -> Any:
    """Return a Triton ``ModelConfig`` message for ``model``.

    With ``max_batch_size > 0`` Triton owns the first axis, so dims drop it and the dynamic
    batcher is on; the caller checks that every tensor's batch axis is open.
    """
    mc = model_config_pb2()
    cfg = mc.ModelConfig(name=model.name, max_batch_size=model.max_batch_size)
    if model.platform:
        cfg.platform = model.platform
    if model.backend:
        cfg.backend = model.backend
    if model.default_model_filename:
        cfg.default_model_filename = model.default_model_filename
    batched = model.max_batch_size > 0
    for t in model.inputs:
        _fill_tensor(cfg.input.add(), t, batched)
    for t in model.outputs:
        _fill_tensor(cfg.output.add(), t, batched)
    if batched:
        cfg.dynamic_batching.SetInParent()
        cfg.dynamic_batching.preferred_batch_size.extend(model.preferred_batch_sizes)
    cfg.instance_group.add(count=model.instance_count, kind=mc.ModelInstanceGroup.Kind.Value(model.instance_kind))
    if model.graph_level is not None:
        cfg.optimization.graph.level = model.graph_level
    for key, value in sorted(model.parameters.items()):
        cfg.parameters[key].string_value = value
    return cfg


def triton_config_pbtxt(model: TritonModel) -> str:
    """Return ``model``'s config.pbtxt: the ModelConfig in protobuf text format."""
    return text_format.MessageToString(triton_model_config(model))
