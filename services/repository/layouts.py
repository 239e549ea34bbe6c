"""Config files the serving engines read: Triton's config.pbtxt, TF Serving's models.config,
OVMS's config.json.

Written as text here (the worker images need no Triton or TF Serving packages); the tests
parse each one with the engine's own protobuf (ModelConfig, ModelServerConfig).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from services.runners.base import TensorSpec

__all__ = [
    "TRITON_DTYPES",
    "ServedModel",
    "ovms_config_json",
    "tfserving_models_config",
    "triton_config_pbtxt",
]

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


def _quote(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid protobuf text-format string


def _tensor_block(kind: str, tensors: Iterable[TensorSpec], batched: bool) -> list[str]:
    lines = [f"{kind} ["]
    items = []
    for t in tensors:
        dims = list(t.shape[1:] if batched else t.shape)
        dims_text = ", ".join(str(d if d is not None else -1) for d in dims) if dims else ""
        body = [f"    name: {_quote(t.name)}", f"    data_type: {TRITON_DTYPES[t.dtype]}"]
        body.append(f"    dims: [ {dims_text} ]" if dims else "    dims: [ 1 ]\n    reshape: { shape: [ ] }")
        items.append("  {\n" + "\n".join(body) + "\n  }")
    lines.append(",\n".join(items))
    lines.append("]")
    return lines


def triton_config_pbtxt(
    name: str,
    *,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    platform: str | None = None,
    backend: str | None = None,
    max_batch_size: int = 0,
    default_model_filename: str | None = None,
    instance_kind: str = "KIND_CPU",
) -> str:
    """Return a Triton model configuration in protobuf text format.

    With ``max_batch_size > 0`` Triton owns the first axis, so dims drop it; that needs every
    input and output to have a dynamic (or matching) batch axis, which the caller checks.
    """
    lines = [f"name: {_quote(name)}"]
    if platform:
        lines.append(f"platform: {_quote(platform)}")
    if backend:
        lines.append(f"backend: {_quote(backend)}")
    lines.append(f"max_batch_size: {max_batch_size}")
    if default_model_filename:
        lines.append(f"default_model_filename: {_quote(default_model_filename)}")
    batched = max_batch_size > 0
    lines += _tensor_block("input", inputs, batched)
    lines += _tensor_block("output", outputs, batched)
    lines.append(f"instance_group [ {{ count: 1 kind: {instance_kind} }} ]")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ServedModel:
    """One model a root config lists: its name and where the server finds its versions."""

    name: str
    base_path: str
    platform: str = "tensorflow"


def tfserving_models_config(models: Iterable[ServedModel]) -> str:
    """Return a TF Serving ``model_config_list`` in protobuf text format."""
    blocks = []
    for m in sorted(models, key=lambda m: m.name):
        blocks.append(
            "  config {\n"
            f"    name: {_quote(m.name)}\n"
            f"    base_path: {_quote(m.base_path)}\n"
            f"    model_platform: {_quote(m.platform)}\n"
            "    model_version_policy { all {} }\n"
            "  }"
        )
    return "model_config_list {\n" + "\n".join(blocks) + "\n}\n"


def ovms_config_json(models: Iterable[ServedModel]) -> str:
    """Return an OpenVINO Model Server ``config.json`` listing ``models``."""
    body = {
        "model_config_list": [
            {"config": {"name": m.name, "base_path": m.base_path, "model_version_policy": {"all": {}}}}
            for m in sorted(models, key=lambda m: m.name)
        ]
    }
    return json.dumps(body, indent=2) + "\n"
