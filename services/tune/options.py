"""What a tune searches, as the service takes it: POST /tune's ``tune`` part and the tune step's options.

The CLI's flags (cli/tune_command.py) and this model describe the same search; both become a
:class:`~services.tune.search.TuneRequest`. The compile settings every candidate shares
(inputs, tolerances, calibration...) stay in the job's CompileSpec.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from services.errors import InvalidSpec
from services.tune.concurrency import CONCURRENCY
from services.tune.search import TuneRequest
from services.tune.space import TUNABLE_TARGETS

__all__ = ["TuneOptions", "load_tune_options"]

Precision = Literal["fp32", "fp16", "int8", "int4"]
_DEFAULT_PRECISIONS: tuple[Precision, ...] = ("fp32", "fp16", "int8")


class TuneOptions(BaseModel):
    """The goals and the space of one tune (the search's defaults where a field is left out)."""

    model_config = ConfigDict(extra="forbid", title="TuneOptions")

    objective: Literal["latency", "throughput", "size"] = Field(
        default="latency", description="What the recommendation is best at: p50 latency, samples/s, or bytes."
    )
    batch: list[int] = Field(
        default_factory=lambda: [1],
        min_length=1,
        max_length=8,
        description="Batch sizes to time (the throughput objective picks among them).",
    )
    max_p99_ms: float | None = Field(default=None, gt=0, description="Only candidates with p99 at most this qualify.")
    targets: list[str] | None = Field(
        default=None,
        description="Targets to search (default: the CPU targets with a settings grid that a live tune worker "
        f"serves: {', '.join(TUNABLE_TARGETS)}).",
    )
    precisions: list[Precision] = Field(
        default_factory=lambda: list(_DEFAULT_PRECISIONS), min_length=1, description="Precisions to build."
    )
    budget_s: float | None = Field(
        default=None,
        gt=0,
        description="Seconds the search may take; it stops early and says so (the service caps it below the "
        "step time limit).",
    )
    rounds: int = Field(default=50, ge=1, le=100_000, description="Interleaved timing rounds per candidate.")
    warmup: int = Field(default=5, ge=0, le=10_000, description="Untimed runs per candidate first.")
    concurrency: list[int] = Field(
        default_factory=lambda: list(CONCURRENCY),
        min_length=1,
        max_length=8,
        description="Throughput objective: concurrent instances the recommendation is measured at.",
    )
    profile: bool = Field(default=True, description="Per-layer profiles of the recommendation and the runner-up.")

    @field_validator("batch", "concurrency")
    @classmethod
    def _positive(cls, values: list[int]) -> list[int]:
        if min(values) < 1 or max(values) > 4096:
            raise ValueError("sizes must be 1 to 4096")
        return values

    def request(self, model: Path, spec_data: dict[str, Any], *, name: str | None = None) -> TuneRequest:
        """Return the search these options describe for ``model``, sharing ``spec_data`` (a CompileSpec's fields)."""
        shared = {k: v for k, v in spec_data.items() if k not in ("targets", "precision", "benchmark", "name")}
        return TuneRequest(
            model=model,
            objective=self.objective,
            batches=list(self.batch),
            max_p99_ms=self.max_p99_ms,
            targets=list(self.targets) if self.targets else None,
            precisions=list(self.precisions),
            budget_s=self.budget_s,
            spec_data=shared,
            rounds=self.rounds,
            warmup=self.warmup,
            profile=self.profile,
            concurrency=list(self.concurrency),
            name=name,
        )


def load_tune_options(data: str | dict[str, Any] | None) -> TuneOptions:
    """Parse the ``tune`` part (JSON text or an object; none: every default); INVALID_SPEC names the fields."""
    if data is None or data == "":
        return TuneOptions()
    try:
        raw = json.loads(data) if isinstance(data, str) else data
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidSpec(
            f"the tune part is not readable JSON: {exc}", errors=[{"field": "tune", "problem": "not JSON"}]
        ) from exc
    if not isinstance(raw, dict):
        raise InvalidSpec("the tune part must be a JSON object", errors=[{"field": "tune", "problem": "not an object"}])
    try:
        options = TuneOptions.model_validate(raw)
    except ValidationError as exc:
        problems = [{"field": "tune." + ".".join(str(p) for p in e["loc"]), "problem": e["msg"]} for e in exc.errors()]
        raise InvalidSpec(
            "invalid tune options: " + "; ".join(f"{p['field']}: {p['problem']}" for p in problems),
            hint='e.g. {"objective": "latency", "batch": [1], "targets": ["onnxruntime", "openvino"]}',
            errors=problems,
        ) from exc
    options.request(
        Path("model"), {}
    ).check()  # the search's own checks (known targets...), now rather than in its step
    return options
