"""The content-addressed cache key: what must rebuild a step, and what must not.

A hit is tested end to end elsewhere (resubmissions, export_again); here each ingredient of
the key is changed on its own. A change that should rebuild and does not would hand a job
another job's artifact, so every ingredient is checked.
"""

from __future__ import annotations

import pytest

from services.graph.planner import PlanStep
from services.pipeline import executor
from services.pipeline.executor import step_cache_key
from services.spec import load_spec

CONVERT = PlanStep(
    id="torchscript-to-onnx",
    kind="convert",
    engine="onnxruntime",
    entry="services.converters.torch_to_onnx:torchscript_to_onnx",
    inputs={"model": "source"},
    options={"opset": None},
)
EXPORT = PlanStep(
    id="export:onnxruntime",
    kind="export",
    engine="onnxruntime",
    entry="services.exporters.onnxruntime:export_onnxruntime",
    inputs={"model": "torchscript-to-onnx", "reference": "reference"},
    options={"precision": "fp32"},
    target="onnxruntime",
)
INPUTS = {"source": "a" * 64}


def _spec(**extra):
    return load_spec({"targets": ["onnxruntime"], **extra})


def _key(step: PlanStep = CONVERT, spec=None, inputs=None, calibration: str | None = None) -> str:
    return step_cache_key(step, spec or _spec(), inputs or INPUTS, calibration)


def test_the_key_is_stable() -> None:
    assert _key() == _key() and _key().startswith("steps/")


UPSTREAM = {**INPUTS, "model": "steps/m"}


@pytest.mark.parametrize(
    ("label", "base", "changed"),
    [
        ("another source", lambda: _key(), lambda: _key(inputs={"source": "b" * 64})),
        (
            "another upstream artifact",
            lambda: _key(EXPORT, inputs=UPSTREAM),
            lambda: _key(EXPORT, inputs={**UPSTREAM, "model": "steps/x"}),
        ),
        (
            "the step's options",
            lambda: _key(),
            lambda: _key(PlanStep(**{**CONVERT.__dict__, "options": {"opset": 17}})),
        ),
        ("another converter", lambda: _key(), lambda: _key(PlanStep(**{**CONVERT.__dict__, "entry": "m:other"}))),
        ("the spec's opset", lambda: _key(), lambda: _key(spec=_spec(opset=17))),
        ("the spec's input shapes", lambda: _key(), lambda: _key(spec=_spec(inputs={"x": {"shape": [1, 3, 8, 8]}}))),
        ("the export's precision", lambda: _key(EXPORT), lambda: _key(EXPORT, spec=_spec(precision="fp16"))),
        ("the export's tolerances", lambda: _key(EXPORT), lambda: _key(EXPORT, spec=_spec(tolerances={"atol": 1.0}))),
        ("the calibration data", lambda: _key(EXPORT), lambda: _key(EXPORT, calibration="c" * 64)),
    ],
)
def test_a_change_that_matters_rebuilds(label: str, base, changed) -> None:
    assert changed() != base(), label


def test_a_new_tool_version_rebuilds(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _key()
    real = executor.tool_versions
    monkeypatch.setattr(executor, "tool_versions", lambda engine: {**real(engine), "onnxruntime": "99.0"})
    assert _key() != before


def test_what_a_conversion_does_not_depend_on_shares_it() -> None:
    # An fp16 or int8 job, another name, other tolerances or benchmark settings reuse the
    # fp32 job's conversion; the export step is where they count.
    base = _key()
    for other in (
        _spec(precision="int8"),
        _spec(name="other", version=3),
        _spec(tolerances={"atol": 1.0}),
        _spec(benchmark=False),
    ):
        assert _key(spec=other) == base, other


def test_how_triton_serves_an_artifact_does_not_rebuild_it() -> None:
    """serving.triton (instances, threads: what kiln tune measured) changes config.pbtxt only, not the export."""
    tuned = _spec(serving={"triton": {"instance_count": 4, "preferred_batch_sizes": [8], "threads": 1}})
    assert _key(EXPORT, spec=tuned) == _key(EXPORT)
    assert _key(spec=tuned) == _key()
    # The rest of serving still counts where it did: the device Triton runs onnxruntime on.
    assert _key(EXPORT, spec=_spec(serving={"onnxruntime_device": "gpu"})) != _key(EXPORT)
