"""Plans persist stable step names; a plan persisted with function paths still runs (issue 22).

The job store keeps each plan as the dict ``Plan.to_dict`` wrote when the job was accepted; a
job queued before an upgrade is run by the new code. Plans used to name each step's function
as ``"module:function"``, and the publish step has since moved out of services/repository.
"""

from __future__ import annotations

from pathlib import Path

from services.descriptors import registry
from services.formats import open_source
from services.graph.planner import Plan, plan_routes
from services.graph.registry import (
    MOVED_ENTRIES,
    OPTIMIZE_ENTRY,
    PUBLISH_ENTRY,
    REFERENCE_ENTRY,
    entry_path,
    load_entry,
    step_functions,
)
from services.pipeline.executor import StepOutcome, run_step, step_cache_key
from services.pipeline.publish import run_publish_step
from services.repository.publish import read_manifest
from services.spec import load_spec

OLD_PUBLISH = "services.repository.step:run_publish_step"


def test_step_names_come_from_the_descriptors() -> None:
    names = step_functions()
    reg = registry()
    assert set(names) == {"reference", "optimize", "publish", "check"} | {f"convert:{c}" for c in reg.converters} | {
        f"export:{t}" for t in reg.targets
    }
    assert names["reference"] == REFERENCE_ENTRY == "services.pipeline.reference:run_reference_step"
    assert names["optimize"] == OPTIMIZE_ENTRY == "services.passes.step:run_optimize_step"
    assert names["publish"] == PUBLISH_ENTRY == "services.pipeline.publish:run_publish_step"
    assert names["check"] == "services.exporters.device_check:run_device_check"  # a GPU-bound target's check
    assert names["export:onnxruntime"] == "services.exporters.onnxruntime:export_onnxruntime"
    assert load_entry("export:onnxruntime").__name__ == "export_onnxruntime"
    assert load_entry("publish") is run_publish_step


def test_every_moved_entry_loads_what_its_new_path_names() -> None:
    assert MOVED_ENTRIES == {OLD_PUBLISH: PUBLISH_ENTRY}
    assert load_entry(OLD_PUBLISH) is run_publish_step
    assert load_entry(PUBLISH_ENTRY) is run_publish_step
    for old, new in MOVED_ENTRIES.items():
        assert entry_path(old) == new
        assert load_entry(old) is load_entry(new)
    # a path that did not move is run as it is (plans from before step names, registries built in code)
    assert entry_path("services.exporters.onnxruntime:export_onnxruntime") == (
        "services.exporters.onnxruntime:export_onnxruntime"
    )
    assert entry_path("jobs_support:ok_step") == "jobs_support:ok_step"


def test_a_queued_plan_naming_function_paths_still_runs_and_publishes(
    cnn_onnx: Path, tmp_path: Path, store, repository
) -> None:
    spec = load_spec({"targets": ["onnxruntime"], "benchmark": False})
    source = open_source(cnn_onnx, tmp_path / "src", spec.source_format)
    current = plan_routes(source.format, spec, default_name="cnn")
    assert [s.entry for s in current.steps] == ["reference", "optimize", "export:onnxruntime", "publish"]
    stored = current.to_dict()
    for s in stored["steps"]:  # the plan as a job accepted before step names (and the publish move) recorded it
        s["entry"] = OLD_PUBLISH if s["kind"] == "publish" else step_functions()[s["entry"]]

    plan = Plan.from_dict(stored)
    assert plan.step("publish:onnxruntime").entry == OLD_PUBLISH
    assert plan.step("export:onnxruntime").entry == "services.exporters.onnxruntime:export_onnxruntime"
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
        # the old form shares the new form's cache key
        assert step_cache_key(step, spec, keys) == step_cache_key(current.step(step.id), spec, keys)

    published = outcomes["publish:onnxruntime"].meta["published"]
    assert (published["name"], published["version"]) == ("cnn", 1)
    manifest = read_manifest(repository, "cnn", 1)
    assert manifest["job_id"] == "queued-before-the-move"
    assert manifest["target"] == "onnxruntime"
    assert manifest["parity"]["passed"] is True
    assert manifest["parity"]["outputs"][0]["name"] == "output"
    assert [s["step"] for s in manifest["steps"]] == ["reference", "optimize", "export:onnxruntime"]
