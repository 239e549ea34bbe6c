"""CompileSpec: what a user asks Kiln to build, and its JSON Schema.

The pydantic model is the only description of the spec: the CLI reads it from --spec,
the API reuses it for `POST /compile`, and `kiln schema` prints the generated JSON Schema.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.errors import InvalidSpec
from services.formats import Format

__all__ = [
    "DEFAULT_TOLERANCES",
    "BenchmarkSpec",
    "CompileSpec",
    "InputSpec",
    "Precision",
    "TargetName",
    "Tolerances",
    "ValidationSpec",
    "load_spec",
    "spec_json_schema",
]


class TargetName(str, Enum):
    """An engine-native artifact a user can ask for."""

    ONNXRUNTIME = "onnxruntime"
    OPENVINO = "openvino"
    TFLITE = "tflite"
    TFSERVING = "tfserving"
    TENSORRT = "tensorrt"


class Precision(str, Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_enum_values=False)


Dim = Annotated[int, Field(ge=-1)]


class InputSpec(_Strict):
    """Shape of one model input. Use ``shape`` for a fixed shape, or min/opt/max for dynamic axes."""

    shape: list[Dim] | None = Field(
        default=None,
        description="Concrete shape used for validation, benchmarks and static engines; -1 keeps an axis dynamic.",
    )
    min: list[Annotated[int, Field(ge=1)]] | None = Field(
        default=None, description="Smallest shape (TensorRT profile)."
    )
    opt: list[Annotated[int, Field(ge=1)]] | None = Field(default=None, description="Shape to optimise for.")
    max: list[Annotated[int, Field(ge=1)]] | None = Field(default=None, description="Largest shape (TensorRT profile).")
    dtype: str | None = Field(default=None, description="Override the input's dtype, e.g. float32, int64.")

    @model_validator(mode="after")
    def _profile_consistent(self) -> InputSpec:
        given = [s for s in (self.min, self.opt, self.max) if s is not None]
        if given and len(given) != 3:
            raise ValueError("give all of min, opt and max, or none of them")
        if given:
            assert self.min is not None and self.opt is not None and self.max is not None
            if not (len(self.min) == len(self.opt) == len(self.max)):
                raise ValueError("min, opt and max must have the same rank")
            for lo, mid, hi in zip(self.min, self.opt, self.max, strict=True):
                if not lo <= mid <= hi:
                    raise ValueError(f"each axis needs min <= opt <= max, got {lo}, {mid}, {hi}")
            if self.shape is not None and len(self.shape) != len(self.opt):
                raise ValueError("shape and opt must have the same rank")
        return self

    def concrete_shape(self) -> list[int] | None:
        """Return the shape to feed for validation: ``shape`` with -1 filled from ``opt``, else ``opt``."""
        if self.shape is not None:
            if self.opt is not None:
                return [o if d == -1 else d for d, o in zip(self.shape, self.opt, strict=True)]
            return list(self.shape)
        return list(self.opt) if self.opt is not None else None


class Tolerances(_Strict):
    """Parity bounds between an artifact and its source model; unset fields take the precision's default."""

    atol: float | None = Field(default=None, ge=0, description="Max absolute error allowed.")
    rtol: float | None = Field(default=None, ge=0, description="Max relative error allowed (|a-b| / (|b| + atol)).")
    min_cosine: float | None = Field(default=None, ge=-1, le=1, description="Minimum cosine similarity per output.")
    min_top1: float | None = Field(
        default=None, ge=0, le=1, description="Minimum top-1 agreement for classifier-shaped outputs."
    )


#: Defaults per precision. fp32 conversions should agree to float rounding; fp16 keeps ~3
#: decimal digits; int8 is judged mainly by cosine and top-1 since elementwise error is coarse.
DEFAULT_TOLERANCES: dict[Precision, Tolerances] = {
    Precision.FP32: Tolerances(atol=1e-4, rtol=1e-3, min_cosine=0.9999, min_top1=1.0),
    Precision.FP16: Tolerances(atol=2e-2, rtol=5e-2, min_cosine=0.999, min_top1=0.9),
    # None: not checked. Elementwise error after int8 quantisation is a poor signal.
    Precision.INT8: Tolerances(atol=None, rtol=None, min_cosine=0.98, min_top1=0.75),
}


class BenchmarkSpec(_Strict):
    """Latency/throughput measurement of each artifact on its engine."""

    enabled: bool = True
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1])
    warmup: int = Field(default=5, ge=0, description="Runs discarded before timing.")
    iterations: int = Field(default=50, ge=1, description="Timed runs per batch size.")


class ValidationSpec(_Strict):
    """How parity inputs are made when no calibration file is given."""

    samples: int = Field(default=8, ge=1, le=1024, description="Number of seeded random samples.")
    seed: int = Field(default=0, description="Seed for the random inputs.")


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"


class CompileSpec(_Strict):
    """What to compile: targets, precision, shapes, naming and checks."""

    targets: list[TargetName] = Field(min_length=1, description="Engines to build artifacts for.")
    precision: Precision = Field(default=Precision.FP32, description="Numeric precision of the artifacts.")
    inputs: dict[str, InputSpec] = Field(
        default_factory=dict, description="Per-input shapes, keyed by input name; dynamic axes need shape or opt."
    )
    max_batch_size: int = Field(default=0, ge=0, description="Triton max_batch_size; 0 disables batching.")
    opset: int | None = Field(default=None, ge=7, le=24, description="ONNX opset for exported graphs.")
    name: str | None = Field(default=None, pattern=NAME_PATTERN, description="Published model name.")
    version: int | None = Field(default=None, ge=1, description="Published version; next free one when unset.")
    calibration: str | None = Field(
        default=None, description="An .npz of arrays keyed by input name, for int8 calibration and parity inputs."
    )
    tolerances: Tolerances = Field(default_factory=Tolerances, description="Parity bounds; unset = precision default.")
    benchmark: BenchmarkSpec | bool = Field(default_factory=BenchmarkSpec, description="true/false or settings.")
    validation: ValidationSpec = Field(default_factory=ValidationSpec)
    source_format: Format | None = Field(default=None, description="Override content-based format detection.")
    signature: str = Field(default="serving_default", description="SavedModel signature to compile.")
    optimize: bool = Field(default=True, description="Run Kiln's ONNX optimisation passes when routing via ONNX.")
    tensorrt_variant: str = Field(
        default="cu13", pattern=r"^cu[0-9]{2}$", description="TensorRT worker variant (queue kiln.tensorrt-<variant>)."
    )
    tensorrt_workspace_mb: int = Field(default=2048, ge=64, description="TensorRT builder workspace limit.")

    @field_validator("targets")
    @classmethod
    def _unique_targets(cls, v: list[TargetName]) -> list[TargetName]:
        if len(set(v)) != len(v):
            raise ValueError("targets must not repeat")
        return v

    @field_validator("benchmark")
    @classmethod
    def _benchmark_object(cls, v: BenchmarkSpec | bool) -> BenchmarkSpec | bool:
        return BenchmarkSpec(enabled=v) if isinstance(v, bool) else v

    @property
    def bench(self) -> BenchmarkSpec:
        """Return the benchmark settings (the field accepts a bare boolean)."""
        assert isinstance(self.benchmark, BenchmarkSpec)
        return self.benchmark

    def tolerances_for(self, precision: Precision | None = None) -> Tolerances:
        """Return the effective tolerances: the spec's fields over the precision's defaults."""
        base = DEFAULT_TOLERANCES[precision or self.precision]
        overrides = self.tolerances.model_dump(exclude_none=True)
        return base.model_copy(update=overrides)


def _format_errors(exc: ValidationError) -> tuple[str, list[dict[str, Any]]]:
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(spec)"
        problems.append({"field": loc, "problem": err["msg"]})
    text = "; ".join(f"{p['field']}: {p['problem']}" for p in problems)
    return text, problems


def load_spec(data: dict[str, Any] | str | Path) -> CompileSpec:
    """Parse a spec from a dict, a JSON string or a JSON file; INVALID_SPEC names the fields."""
    try:
        if isinstance(data, Path):
            data = json.loads(data.read_text())
        elif isinstance(data, str):
            data = json.loads(data)
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidSpec(f"spec is not readable JSON: {exc}") from exc
    except RecursionError as exc:  # json's decoder recurses once per level of [ or {
        raise InvalidSpec(
            "spec is nested too deeply to read", errors=[{"field": "(spec)", "problem": "nested too deeply"}]
        ) from exc
    if not isinstance(data, dict):
        raise InvalidSpec("spec must be a JSON object")
    try:
        return CompileSpec.model_validate(data)
    except ValidationError as exc:
        text, problems = _format_errors(exc)
        hint = None
        if any(p["field"].startswith("targets") for p in problems):
            hint = "Valid targets: " + ", ".join(t.value for t in TargetName) + "."
        raise InvalidSpec(f"invalid spec: {text}", hint=hint, errors=problems) from exc


def spec_json_schema() -> dict[str, Any]:
    """Return the CompileSpec JSON Schema (the one the API's OpenAPI document embeds)."""
    return CompileSpec.model_json_schema()
