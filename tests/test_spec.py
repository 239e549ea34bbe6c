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
        ({"targets": ["onnxruntime"], "precision": "int2"}, "precision"),
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
    assert targets == ["onnxruntime", "openvino", "tflite", "tfserving", "tensorrt", "tvm"]
    assert schema["additionalProperties"] is False


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"version": 10**30}, "version"),
        ({"version": 2**31}, "version"),
        ({"validation": {"seed": -1}}, "validation.seed"),
        ({"validation": {"seed": 2**64}}, "validation.seed"),
        ({"benchmark": {"iterations": 10**12}}, "benchmark.iterations"),
        ({"benchmark": {"warmup": 10**12}}, "benchmark.warmup"),
        ({"benchmark": {"batch_sizes": [1, 10**9]}}, "benchmark.batch_sizes.1"),
        ({"benchmark": {"batch_sizes": list(range(1, 100))}}, "benchmark.batch_sizes"),
        ({"max_batch_size": 10**12}, "max_batch_size"),
        ({"tensorrt_workspace_mb": 10**12}, "tensorrt_workspace_mb"),
        ({"inputs": {"x": {"shape": [1, 10**12]}}}, "inputs.x.shape.1"),
        ({"inputs": {"x": {"min": [1], "opt": [1], "max": [10**12]}}}, "inputs.x.max.0"),
    ],
)
def test_out_of_bounds_fields_are_refused_naming_the_field(extra: dict, field: str) -> None:
    with pytest.raises(InvalidSpec) as exc:
        load_spec({"targets": ["onnxruntime"], **extra})
    assert [e["field"] for e in exc.value.details["errors"]] == [field]
    assert exc.value.code == "INVALID_SPEC" and field in exc.value.message and exc.value.hint


@pytest.mark.parametrize(
    ("extra", "field", "estimate"),
    [
        # 8 validation samples of 1x3x100000x100000 float32: ~894 GiB (and one benchmark batch, 112 GiB).
        ({"inputs": {"x": {"shape": [1, 3, 100000, 100000]}}}, "inputs.x", "894 GiB"),
        (
            {"inputs": {"x": {"shape": [1, 3, 224, 224]}}, "benchmark": {"batch_sizes": [1, 8000]}},
            "benchmark.batch_sizes",
            "4.49 GiB",
        ),
        (
            {"inputs": {"ids": {"min": [1, 1], "opt": [1, 8], "max": [65536, 1048576], "dtype": "int64"}}},
            "inputs.ids.max",
            "512 GiB",
        ),
    ],
)
def test_specs_that_would_allocate_too_much_are_refused_with_an_estimate(
    extra: dict, field: str, estimate: str
) -> None:
    with pytest.raises(InvalidSpec) as exc:
        load_spec({"targets": ["onnxruntime"], **extra})
    problems = {e["field"]: e["problem"] for e in exc.value.details["errors"]}
    assert field in problems and estimate in problems[field] and "the limit is 4 GiB" in problems[field]
    assert "batch_sizes" in exc.value.hint
    # Without the benchmark the same shapes are fine where only the benchmark was too big.
    if field == "benchmark.batch_sizes":
        assert load_spec({"targets": ["onnxruntime"], **extra, "benchmark": False}).bench.enabled is False


def test_the_schema_carries_the_bounds() -> None:
    schema = spec_json_schema()
    props, defs = schema["properties"], schema["$defs"]
    version = next(v for v in props["version"]["anyOf"] if v.get("type") == "integer")
    assert version["maximum"] == 2**31 - 1 and version["minimum"] == 1
    assert defs["ValidationSpec"]["properties"]["seed"]["minimum"] == 0
    assert defs["BenchmarkSpec"]["properties"]["iterations"]["maximum"] == 100_000
    batch_sizes = defs["BenchmarkSpec"]["properties"]["batch_sizes"]["anyOf"][0]  # an array, or null for the default
    assert batch_sizes["items"]["maximum"] == 65_536 and batch_sizes["maxItems"] == 16
