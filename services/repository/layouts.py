"""Where each server's models live in the repository, and the root configs of TF Serving and OVMS.

One root per server, so each server mounts a tree it can load whole (Triton's default
``--exit-on-error`` refuses to start when any model directory in its root fails to load):

- ``triton/``: onnxruntime, openvino and tensorrt models, each with its ``config.pbtxt``;
- ``tfserving/``: SavedModels and ``models.config`` (TF Serving's ``model_config_list``);
- ``tflite/``: ``.tflite`` files, for on-device runtimes (and OVMS);
- ``tvm/``: TVM libraries (``model.so``, ``params.bin``, ``io.json``, a README per version);
- ``ovms/``: ``config.json`` only. OVMS serves models from the other roots where they already
  are (IR, ONNX, SavedModel, TFLite), so nothing is stored twice.

TF Serving's config is text here (the worker images need no TF Serving package; the tests
parse it with ``ModelServerConfig``). Triton's config is built from its own proto in
:mod:`services.repository.triton_config`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "OVMS_CONFIG",
    "OVMS_F32",
    "ROOTS",
    "TFSERVING_CONFIG",
    "ServedModel",
    "ovms_config_json",
    "server_root",
    "tfserving_models_config",
]

TRITON_ROOT, TFSERVING_ROOT, TFLITE_ROOT, OVMS_ROOT = "triton", "tfserving", "tflite", "ovms"
TVM_ROOT = "tvm"
#: Every root a model can be published under.
ROOTS = (TRITON_ROOT, TFSERVING_ROOT, TFLITE_ROOT, TVM_ROOT)
TFSERVING_CONFIG = f"{TFSERVING_ROOT}/models.config"
OVMS_CONFIG = f"{OVMS_ROOT}/config.json"

#: OVMS runs every format on OpenVINO, whose CPU plugin defaults to bf16 on CPUs with
#: AVX512-BF16/AMX; Kiln checks parity at f32, so OVMS is told to keep f32.
OVMS_F32 = {"plugin_config": {"INFERENCE_PRECISION_HINT": "f32"}}


def server_root(target: str, serving: dict[str, Any]) -> str:
    """Return the root a model is published under: its exporter's server, else its target's."""
    if serving.get("triton") or target in ("onnxruntime", "openvino", "tensorrt"):
        return TRITON_ROOT
    if serving.get("tfserving") or target == "tfserving":
        return TFSERVING_ROOT
    if serving.get("tvm") or target == "tvm":
        return TVM_ROOT
    return TFLITE_ROOT


def _quote(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid protobuf text-format string


@dataclass(frozen=True)
class ServedModel:
    """One model a root config lists: its name and where the server finds its versions."""

    name: str
    base_path: str
    platform: str = "tensorflow"
    #: OVMS plugin_config (OpenVINO properties), e.g. the inference precision Kiln validated.
    plugin_config: dict[str, str] = field(default_factory=dict)


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
    entries = []
    for m in sorted(models, key=lambda m: m.name):
        config: dict[str, Any] = {"name": m.name, "base_path": m.base_path, "model_version_policy": {"all": {}}}
        if m.plugin_config:
            config["plugin_config"] = dict(m.plugin_config)
        entries.append({"config": config})
    body = {"model_config_list": entries}
    return json.dumps(body, indent=2) + "\n"
