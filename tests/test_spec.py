"""CompileSpec: JSON field names, validation errors that name the field, the generated schema."""

from __future__ import annotations

import json

import pytest

from services.errors import InvalidSpec
from services.spec import CompileSpec, Precision, load_spec, spec_json_schema


def test_full_spec_round_trips() -> None:
    body = {
        "targets": ["onnxruntime", "openvino"],
        "precision": "fp16",
        "inputs": {"input": {"min": [1, 3, 32, 32], "opt": [4, 3, 32, 32], "max": [8, 3, 32, 32]}},
        "max_batch_size": 8,
        "opset": 17,
        "name": "resnet-tiny",
        "version": 3,
        "calibration": "calib.npz",
        "tolerances": {"atol": 0.05},
        "benchmark": {"batch_sizes": [1, 4], "iterations": 10},
    }
    spec = load_spec(json.dumps(body))
    assert spec.precision is Precision.FP16
    assert spec.inputs["input"].concrete_shape() == [4, 3, 32, 32]
    assert spec.bench.batch_sizes == [1, 4]
    tol = spec.tolerances_for()
    assert tol.atol == 0.05 and tol.rtol == 5e-2  # override + fp16 default
    assert CompileSpec.model_validate(spec.model_dump()) == spec


def test_benchmark_accepts_boolean() -> None:
    assert load_spec({"targets": ["onnxruntime"], "benchmark": False}).bench.enabled is False


def test_unknown_target_lists_valid_ones() -> None:
    with pytest.raises(InvalidSpec) as exc:
        load_spec({"targets": ["coreml"]})
    assert exc.value.details["errors"][0]["field"] == "targets.0"
    assert "onnxruntime" in exc.value.hint and "tensorrt" in exc.value.hint


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"targets": []}, "targets"),
        ({"targets": ["onnxruntime"], "precision": "int4"}, "precision"),
        ({"targets": ["onnxruntime"], "name": "../escape"}, "name"),
        ({"targets": ["onnxruntime"], "tagets": 1}, "tagets"),
        ({"targets": ["onnxruntime", "onnxruntime"]}, "targets"),
        ({"targets": ["onnxruntime"], "inputs": {"x": {"min": [1], "opt": [4]}}}, "inputs.x"),
        ({"targets": ["onnxruntime"], "inputs": {"x": {"min": [8], "opt": [4], "max": [9]}}}, "inputs.x"),
    ],
)
def test_invalid_spec_names_the_field(body: dict, field: str) -> None:
    with pytest.raises(InvalidSpec) as exc:
        load_spec(body)
    assert exc.value.code == "INVALID_SPEC"
    assert any(e["field"] == field for e in exc.value.details["errors"]), exc.value.details


def test_not_json() -> None:
    with pytest.raises(InvalidSpec, match="not readable JSON"):
        load_spec("{targets:")


def test_schema_is_generated_from_the_model() -> None:
    schema = spec_json_schema()
    assert schema["required"] == ["targets"]
    assert set(schema["properties"]) == set(CompileSpec.model_fields)
    targets = schema["$defs"]["TargetName"]["enum"]
    assert targets == ["onnxruntime", "openvino", "tflite", "tfserving", "tensorrt"]
    assert schema["additionalProperties"] is False
