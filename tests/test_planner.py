"""The route planner on toy edges and on the real registry."""

from __future__ import annotations

import pytest

from services.descriptors import registry
from services.errors import NoRoute
from services.formats import Format
from services.graph import Converter, Exporter, Registry, default_registry, plan_routes
from services.spec import Precision, TargetName, load_spec

F = Format


def _toy() -> Registry:
    reg = Registry()
    for name, src, dst, engine, cost in [
        ("a-b", F.KERAS, F.ONNX, "tensorflow", 1.0),
        ("a-c", F.KERAS, F.SAVEDMODEL, "tensorflow", 1.0),
        ("c-b", F.SAVEDMODEL, F.ONNX, "tensorflow", 5.0),
        ("b-d", F.ONNX, F.OPENVINO_IR, "openvino", 1.0),
        ("c-d", F.SAVEDMODEL, F.OPENVINO_IR, "openvino", 1.0),
    ]:
        reg.add_converter(Converter(name, src, dst, engine, cost, f"toy:{name}", "toy"))
    reg.add_exporter(Exporter(TargetName.ONNXRUNTIME, "onnxruntime", {F.ONNX: 1.0}, "toy:ort"))
    reg.add_exporter(Exporter(TargetName.OPENVINO, "openvino", {F.OPENVINO_IR: 1.0}, "toy:ov"))
    reg.add_exporter(
        Exporter(
            TargetName.TFSERVING,
            "tensorflow",
            {F.SAVEDMODEL: 1.0},
            "toy:tfs",
            precisions={F.SAVEDMODEL: frozenset({Precision.FP32})},
        )
    )
    return reg


def test_registry_refuses_silent_overwrite() -> None:
    reg = _toy()
    with pytest.raises(ValueError, match="already registered"):
        reg.add_converter(Converter("a-b", F.KERAS, F.ONNX, "tensorflow", 9.0, "x:y", "x"))
    with pytest.raises(KeyError, match="known: a-b"):
        reg.converter("nope")


def test_cheapest_route_and_prefix_sharing() -> None:
    spec = load_spec({"targets": ["tfserving", "openvino"], "optimize": False})
    plan = plan_routes(F.KERAS, spec, _toy())
    # openvino has two routes of cost 3 (a-b,b-d and a-c,c-d); the one sharing a-c with tfserving wins.
    assert plan.routes["openvino"] == "keras → savedmodel → openvino_ir ⇒ openvino"
    assert plan.shared == ["a-c"]
    converts = [s.id for s in plan.steps if s.kind == "convert" and not s.fallback]
    assert converts == ["a-c", "a-c/c-d"]
    export = plan.step("export:openvino")
    assert export.inputs == {"model": "a-c/c-d", "reference": "reference"}
    assert export.queue == "kiln.openvino"


def test_optimize_step_after_onnx() -> None:
    spec = load_spec({"targets": ["onnxruntime", "openvino"]})
    plan = plan_routes(F.KERAS, spec, _toy())
    ids = [s.id for s in plan.steps]
    assert "a-b/optimize" in ids
    assert plan.step("export:onnxruntime").inputs["model"] == "a-b/optimize"
    assert plan.routes["onnxruntime"] == "keras → onnx → optimize ⇒ onnxruntime"


def test_no_route_lists_what_is_reachable() -> None:
    spec = load_spec({"targets": ["tfserving"], "precision": "fp16"})
    with pytest.raises(NoRoute) as exc:
        plan_routes(F.KERAS, spec, _toy())
    err = exc.value
    assert err.details["reachable_formats"] == ["keras", "onnx", "openvino_ir", "savedmodel"]
    assert "tfserving from this source is possible at: fp32" in err.hint
    with pytest.raises(NoRoute) as exc2:
        plan_routes(F.ONNX, load_spec({"targets": ["tfserving"]}), _toy())
    assert exc2.value.details["reachable_formats"] == ["onnx", "openvino_ir"]
    assert exc2.value.details["reachable_targets"] == ["onnxruntime", "openvino"]


def test_real_registry_onnx_source() -> None:
    spec = load_spec({"targets": ["onnxruntime", "openvino"], "precision": "int8"})
    plan = plan_routes(F.ONNX, spec)
    assert [s.id for s in plan.steps if not s.fallback] == [
        "reference",
        "optimize",
        "export:onnxruntime",
        "publish:onnxruntime",
        "optimize/onnx-to-openvino-ir",
        "export:openvino",
        "publish:openvino",
    ]
    assert plan.shared == ["optimize"]
    assert plan.step("reference").queue == "kiln.onnxruntime"
    assert plan.step("optimize/onnx-to-openvino-ir").queue == "kiln.openvino"
    assert plan.step("publish:openvino").options["name"] == "model-openvino"


def test_real_registry_every_edge_importable_module_names() -> None:
    reg = default_registry()
    engines = reg.engines()
    assert engines >= {"onnxruntime", "openvino", "tensorflow", "tensorrt"}
    assert engines == set(registry().engines)  # every descriptor's engine runs some edge or target
    for conv in reg.converters:
        module, _, func = conv.entry.partition(":")
        assert module.startswith("services.converters.") and func


def test_tensorrt_plan_source_is_refused() -> None:
    with pytest.raises(NoRoute, match="cannot be converted"):
        plan_routes(F.TENSORRT_PLAN, load_spec({"targets": ["onnxruntime"]}))


def test_plan_round_trips_through_json() -> None:
    from services.graph import Plan

    plan = plan_routes(F.KERAS, load_spec({"targets": ["tflite", "onnxruntime"]}))
    again = Plan.from_dict(plan.to_dict())
    assert again.to_dict() == plan.to_dict()


def test_fallback_routes_follow_in_cost_order() -> None:
    spec = load_spec({"targets": ["tfserving", "openvino"], "optimize": False})
    plan = plan_routes(F.KERAS, spec, _toy())
    # openvino: a-c,c-d (3, shares a-c) first; then a-b,b-d (3); then a-c,c-b,b-d (8).
    assert [(o.route, o.cost, o.export, o.publish) for o in plan.route_options("openvino")] == [
        ("keras → savedmodel → openvino_ir ⇒ openvino", 3.0, "export:openvino", "publish:openvino"),
        ("keras → onnx → openvino_ir ⇒ openvino", 3.0, "export:openvino@2", "publish:openvino@2"),
        ("keras → savedmodel → onnx → openvino_ir ⇒ openvino", 8.0, "export:openvino@3", "publish:openvino@3"),
    ]
    assert plan.step("export:openvino@2").inputs == {"model": "a-b/b-d", "reference": "reference"}
    assert plan.step("a-c/c-b/b-d").fallback and not plan.step("a-c").fallback
    # tfserving has one route: nothing to fall back to. Fallback steps come after every first choice.
    assert [o.export for o in plan.route_options("tfserving")] == ["export:tfserving"]
    first = [s.fallback for s in plan.steps]
    assert first == sorted(first)
    assert plan_routes(F.KERAS, spec, _toy(), fallbacks=0).route_options("openvino")[1:] == []


def test_real_registry_fallbacks_for_keras() -> None:
    plan = plan_routes(F.KERAS, load_spec({"targets": ["onnxruntime", "tflite"]}))
    assert [o.route for o in plan.route_options("onnxruntime")] == [
        "keras → onnx → optimize ⇒ onnxruntime",
        "keras → savedmodel → onnx → optimize ⇒ onnxruntime",
    ]
    assert [o.route for o in plan.route_options("tflite")] == [
        "keras → savedmodel ⇒ tflite",
        "keras → onnx → optimize → savedmodel ⇒ tflite",
    ]
    assert plan.route_options("onnxruntime")[1].tools == ("tf.saved_model", "tf2onnx")


def test_only_routes_the_served_engines_run_are_planned() -> None:
    """Issue 27: openvino's fallback through TensorFlow, planned for a service with no TensorFlow worker,
    waited on kiln.tensorflow for nobody. Routes are planned onto engines that can run them."""
    spec = load_spec({"targets": ["openvino"]})
    every = plan_routes(Format.ONNX, spec)
    assert any(s.engine == "tensorflow" for s in every.steps)  # a fallback through onnx2tf exists
    served = plan_routes(Format.ONNX, spec, engines={"onnxruntime", "openvino"})
    assert {s.engine for s in served.steps} <= {"onnxruntime", "openvino"}
    assert [o.route for o in served.route_options("openvino")] == ["onnx → optimize → openvino_ir ⇒ openvino"]
    # No route the served engines can run: the cheapest is kept, so the submission names what is missing.
    tflite = plan_routes(Format.ONNX, load_spec({"targets": ["tflite"]}), engines={"onnxruntime"})
    assert len(tflite.route_options("tflite")) == 1
    assert "tensorflow" in {s.engine for s in tflite.steps}


def test_a_route_s_engines_include_the_optimiser_s() -> None:
    reg = default_registry()
    routes = _routes(reg, Format.KERAS, TargetName.OPENVINO)
    via_onnx = next(r for r in routes if [c.target for c in r.converters] == [Format.ONNX, Format.OPENVINO_IR])
    spec = load_spec({"targets": ["openvino"]})
    assert via_onnx.engines(Format.KERAS, spec) == {"tensorflow", "onnxruntime", "openvino"}
    no_passes = load_spec({"targets": ["openvino"], "optimize": False})
    assert via_onnx.engines(Format.KERAS, no_passes) == {"tensorflow", "openvino"}


def _routes(reg: Registry, source: Format, target: TargetName) -> list:
    from services.graph.planner import _candidate_routes

    return _candidate_routes(reg, source, target, Precision.FP32)
