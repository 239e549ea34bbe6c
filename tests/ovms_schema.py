"""The part of OVMS's config.json schema that Kiln's files use, checked as OVMS checks it at start.

Transcribed from MODELS_CONFIG_SCHEMA in OpenVINO Model Server's src/schema.cpp (OVMS
validates config.json against it with rapidjson and refuses to start on a mismatch): unknown
keys are errors at every level. Pipelines and custom loaders are left out; Kiln writes neither.
"""

from __future__ import annotations

from typing import Any

import jsonschema

__all__ = ["OVMS_CONFIG_SCHEMA", "check_ovms_config"]

_MODEL_CONFIG = {
    "type": "object",
    "required": ["config"],
    "properties": {
        "config": {
            "type": "object",
            "required": ["name", "base_path"],
            "properties": {
                "name": {"type": "string"},
                "base_path": {"type": "string"},
                "batch_size": {"type": ["integer", "string"], "minimum": 0},
                "model_version_policy": {"type": "object"},
                "shape": {"type": ["object", "string"]},
                "nireq": {"type": "integer", "minimum": 0},
                "target_device": {"type": "string"},
                # OVMS passes each entry to OpenVINO as a property: strings or numbers.
                "plugin_config": {"type": "object", "additionalProperties": {"type": ["string", "number"]}},
                "stateful": {"type": "boolean"},
                "idle_sequence_cleanup": {"type": "boolean"},
                "low_latency_transformation": {"type": "boolean"},
                "max_sequence_number": {"type": "integer", "minimum": 0},
            },
            "additionalProperties": False,
        }
    },
    "additionalProperties": False,
}

OVMS_CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model_config_list"],
    "properties": {"model_config_list": {"type": "array", "items": _MODEL_CONFIG}},
    "additionalProperties": False,
}


def check_ovms_config(config: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError unless ``config`` is a config.json OVMS accepts; names must be unique."""
    jsonschema.validate(config, OVMS_CONFIG_SCHEMA)
    names = [m["config"]["name"] for m in config["model_config_list"]]
    assert len(names) == len(set(names)), f"OVMS refuses duplicate model names: {names}"
