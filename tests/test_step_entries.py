"""A plan persisted before a step function moved still runs (services/graph/registry.py MOVED_ENTRIES).

The job store keeps each plan as the dict ``Plan.to_dict`` wrote when the job was accepted; a
job queued before an upgrade is run by the new code. Here the publish step is written the way
plans named it before it moved out of services/repository (issue 22).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from services.formats import open_source
from services.graph.planner import Plan, plan_routes
from services.graph.registry import MOVED_ENTRIES, PUBLISH_ENTRY, current_entry, load_entry
from services.pipeline.executor import StepOutcome, run_step, step_cache_key
from services.pipeline.publish import run_publish_step
from services.repository.publish import read_manifest
from services.spec import load_spec

OLD_PUBLISH = "services.repository.step:run_publish_step"


def test_every_moved_entry_loads_what_its_new_path_names() -> None:
    assert MOVED_ENTRIES == {OLD_PUBLISH: PUBLISH_ENTRY}
    assert load_entry(OLD_PUBLISH) is run_publish_step
    assert load_entry(PUBLISH_ENTRY) is run_publish_step
    for old, new in MOVED_ENTRIES.items():
        assert current_entry(old) == new
        assert load_entry(old) is load_entry(new)
    assert current_entry("services.exporters.onnxruntime:export_onnxruntime") == (
        "services.exporters.onnxruntime:export_onnxruntime"
    )


def test_a_queued_plan_naming_the_old_publish_path_still_publishes(
    cnn_onnx: Path, tmp_path: Path, store, repository
) -> None:
    spec = load_spec({"targets": ["onnxruntime"], "benchmark": False})
    source = open_source(cnn_onnx, tmp_path / "src", spec.source_format)
    stored = plan_routes(source.format, spec, default_name="cnn").to_dict()
    publishes = [s for s in stored["steps"] if s["kind"] == "publish"]
    assert [s["entry"] for s in publishes] == [PUBLISH_ENTRY]
    for s in publishes:  # the plan as a job accepted before the move recorded it
        s["entry"] = OLD_PUBLISH

    plan = Plan.from_dict(stored)
    assert plan.step("publish:onnxruntime").entry == OLD_PUBLISH
    outcomes: dict[str, StepOutcome] = {}
    for step in plan.steps:
        keys = {role: outcomes[dep].key or "" for role, dep in step.inputs.items() if dep != "source"}
        outcomes[step.id] = run_step(
            step,
            job_id="queued-before-the-move",
            spec=spec,
            source=source,
            input_keys=keys,
            store=store,
            scratch=tmp_path / "steps" / step.id.replace(":", "-"),
            repository=repository,
        )
        if step.kind == "publish":  # the old form shares the new form's cache key
            fresh = dataclasses.replace(step, entry=PUBLISH_ENTRY)
            assert step_cache_key(step, spec, keys) == step_cache_key(fresh, spec, keys)

    published = outcomes["publish:onnxruntime"].meta["published"]
    assert (published["name"], published["version"]) == ("cnn", 1)
    manifest = read_manifest(repository, "cnn", 1)
    assert manifest["job_id"] == "queued-before-the-move"
    assert manifest["target"] == "onnxruntime"
    assert manifest["parity"]["passed"] is True
    assert manifest["parity"]["outputs"][0]["name"] == "output"
    assert [s["step"] for s in manifest["steps"]] == ["reference", "optimize", "export:onnxruntime"]
