"""The pieces of a tune job that need no service: its plan, its options, the progress lines its
step may send from the sandbox, and the Pareto front its page draws."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.ui.tune_charts import tune_scatter
from services.errors import InvalidSpec
from services.formats import Format
from services.graph.planner import Plan
from services.jobs.database import JobDatabase
from services.jobs.models import Base
from services.jobs.scheduling import StepScheduler
from services.jobs.store import JobStore, NewJob
from services.tune.options import TuneOptions, load_tune_options
from services.tune.plan import TUNE_ENGINE, plan_tune
from workers.child import MAX_PROGRESS_CHARS, MAX_PROGRESS_DATA_BYTES, checked_progress
from workers.probe import resolve_served
from workers.queues import serves_tune


def test_a_tune_plan_is_a_search_step_then_its_publish_on_the_tune_queue() -> None:
    options = load_tune_options(json.dumps({"objective": "throughput", "batch": [1, 8]}))
    plan = plan_tune(Format.ONNX, options, ["onnxruntime", "openvino"], "resnet")
    tune, publish = plan.steps
    assert (tune.kind, tune.engine, tune.queue) == ("tune", TUNE_ENGINE, "kiln.tune")
    assert tune.options["tune"]["targets"] == ["onnxruntime", "openvino"]
    assert tune.options["tune"]["batch"] == [1, 8]
    assert tune.options["tool_engines"] == ["onnxruntime", "openvino"]
    assert publish.inputs == {"model": "tune"} and publish.options["name"] == "resnet"
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.kind == "tune" and [s.id for s in again.steps] == ["tune", "publish:tune"]
    old = plan.to_dict()
    del old["kind"]  # a plan stored before tune jobs existed
    assert Plan.from_dict(old).kind == "compile"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"objective": "fast"}', "tune.objective"),
        ('{"batch": []}', "tune.batch"),
        ('{"max_p99_ms": 0}', "tune.max_p99_ms"),
        ('{"budget_s": -1}', "tune.budget_s"),
        ('{"concurrency": [100000]}', "tune.concurrency"),
    ],
)
def test_tune_options_name_the_field_they_refuse(text: str, field: str) -> None:
    with pytest.raises(InvalidSpec) as err:
        load_tune_options(text)
    assert field in [e["field"] for e in err.value.details["errors"]]


def test_no_tune_part_means_the_searchs_defaults() -> None:
    assert load_tune_options(None) == TuneOptions()
    req = TuneOptions().request(Path("m.onnx"), {"targets": ["tflite"], "inputs": {"x": {}}})
    assert req.targets is None and "targets" not in req.spec_data and req.spec_data["inputs"] == {"x": {}}


def test_progress_from_a_step_is_bounded_text_or_bounded_json() -> None:
    assert checked_progress("x" * (MAX_PROGRESS_CHARS + 10)) == "x" * MAX_PROGRESS_CHARS
    assert checked_progress(["not", "a", "line"]) == "['not', 'a', 'line']"
    line = checked_progress({"message": "built fp32", "tune": {"type": "tune_built", "built": [1, 2]}, "extra": 1})
    assert line == {"message": "built fp32", "tune": {"type": "tune_built", "built": [1, 2]}}
    huge = checked_progress({"message": "m", "tune": {"blob": "y" * MAX_PROGRESS_DATA_BYTES}})
    assert huge == {"message": "m"}  # too much data: the line stays, its data goes
    assert checked_progress({"message": "m", "tune": "not an object"}) == {"message": "m"}


def test_progress_with_tune_data_is_recorded_with_its_line(tmp_path) -> None:
    db = JobDatabase(f"sqlite:///{tmp_path / 'jobs.db'}")
    Base.metadata.create_all(db.engine)
    jobs, steps = JobStore(db), StepScheduler(db)
    plan = plan_tune(Format.ONNX, TuneOptions(), ["onnxruntime", "openvino"], "m")
    new = NewJob(
        name="m",
        spec={"targets": ["onnxruntime", "openvino"]},
        plan=plan,
        source_key="sources/x",
        source_sha256="0" * 64,
        source_filename="m.onnx",
        source_format="onnx",
    )
    job_id = jobs.create_job(new)
    steps.progress(job_id, "tune", ["plain line", {"message": "built fp32", "tune": {"type": "tune_built"}}])
    recorded = [e.data for e in jobs.events(job_id) if e.type == "progress"]
    assert recorded == [{"message": "plain line"}, {"message": "built fp32", "tune": {"type": "tune_built"}}]


def test_which_workers_take_tune_jobs() -> None:
    assert serves_tune(["onnxruntime", "openvino"]) and serves_tune(["openvino", "tensorflow", "mnn"])
    assert not serves_tune(["onnxruntime"]) and not serves_tune(["onnxruntime", "mnn", "ncnn"])
    loaded, queues = resolve_served(["tune"])
    assert queues == ["tune"] and len(loaded) >= 2  # this machine has onnxruntime, openvino and tensorflow
    assert resolve_served(["onnxruntime"]) == (["onnxruntime"], ["onnxruntime"])


def _row(target: str, p50: float, snr: float | None, meets: bool = True) -> dict:
    return {
        "id": f"{target}/{p50}",
        "target": target,
        "precision": "fp32",
        "settings_text": "defaults",
        "batch": 1,
        "p50_ms": p50,
        "min_snr_db": snr,
        "meets": meets,
    }


def test_the_pareto_front_keeps_what_no_qualifying_point_beats_on_both_axes() -> None:
    rows = [
        _row("a", 1.0, 40.0),  # fastest: on the front
        _row("b", 2.0, 60.0),  # slower but more accurate: on the front
        _row("c", 3.0, 50.0),  # beaten by b on both: off
        _row("d", 0.5, 90.0, meets=False),  # beats everything but does not qualify: off, and beats no one
        _row("e", 4.0, float("inf")),  # identical outputs: capped, most accurate, on the front
        _row("f", 5.0, None),  # not timed against the source: off
    ]
    chart = tune_scatter(rows, recommended="a/1.0")
    assert chart is not None
    front = {p.label.split()[0] for p in chart.points if p.on_front}
    assert front == {"a", "b", "e"}
    (rec,) = [p for p in chart.points if p.recommended]
    assert rec.label.startswith("a ") and chart.front.startswith(f"M{rec.cx},{rec.cy}")
    xs = {p.label.split()[0]: p.cx for p in chart.points}
    assert xs["d"] < xs["a"] < xs["b"] < xs["c"] < xs["e"] < xs["f"]  # latency grows to the right
    ys = {p.label.split()[0]: p.cy for p in chart.points}
    assert ys["e"] < ys["b"] < ys["c"] < ys["a"]  # higher SNR is higher up (smaller y)


def test_mnn_and_ncnn_are_searched_over_their_thread_counts_when_asked_for() -> None:
    from services.tune.space import default_targets, runner_options, settings_grid

    for target in ("mnn", "ncnn"):
        assert settings_grid(target, "latency", cpus=4) == [{"threads": 4}, {"threads": 1}]
        assert runner_options(target, {"threads": 4}) == {"threads": 4}
        assert target not in default_targets()  # only when --targets names them
    assert settings_grid("tvm", "latency", cpus=4) == [{}]


def test_a_tunes_cache_key_names_the_host_it_measured_on_and_nonfinite_snr_does_not_break_it() -> None:
    import os

    from services.pipeline.executor import _step_tools
    from services.tune.build import parity_summary

    plan = plan_tune(Format.ONNX, TuneOptions(), ["onnxruntime", "openvino"], "m")
    tools = _step_tools(plan.steps[0])
    assert tools["host"]["cpus"] == os.cpu_count() and tools["host"]["cpu"]
    assert "host" not in _step_tools(plan.steps[1])  # the publish measures nothing
    summary = parity_summary({"passed": False, "outputs": [{"snr_db": "-inf"}, {"snr_db": 30.0}]})
    assert summary is not None and summary["min_snr_db"] is None and summary["passed"] is False
