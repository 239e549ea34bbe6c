"""The plan of a tune job (POST /tune): one tune step, then the publish of what it recommends.

A tune needs every engine it compares in one process (its candidates are timed side by side,
interleaved round by round), so it is one step on its own queue, ``kiln.tune``, which workers
serving several tunable engines also take (workers/main.py). Inside the step the search runs
the compile pipeline in-process on the step's sandboxed child, as `kiln tune` does. The
publish step runs on the worker itself, where the repository's credentials are, like every
publish step; its input is the recommended export artifact the tune step hands back.

The plan names one pseudo-target, ``tune``, whose route is these two steps: the job store,
the job views and the artifact download treat it as they treat a target (its artifact is the
recommendation's export), so nothing there needs a case of its own.
"""

from __future__ import annotations

from services.descriptors import registry
from services.formats import Format
from services.graph.planner import Plan, PlanStep, RouteOption
from services.tune.options import TuneOptions, load_tune_options

__all__ = ["TUNE_ENGINE", "TUNE_TARGET", "plan_tune", "replan_tune"]

#: The queue engine of tune steps: ``kiln.tune``, taken by workers that serve several tunable engines.
TUNE_ENGINE = "tune"
#: The pseudo-target a tune job's result is recorded under.
TUNE_TARGET = "tune"
_ROUTE = "tune → publish"


def plan_tune(source_format: Format, options: TuneOptions, targets: list[str], name: str) -> Plan:
    """Return the tune job's plan: search ``targets`` with ``options``, publish the recommendation as ``name``."""
    search = options.model_dump(mode="json")
    search["targets"] = list(targets)
    tune = PlanStep(
        id="tune",
        kind="tune",
        engine=TUNE_ENGINE,
        entry="services.tune.step:run_tune_step",
        inputs={"model": "source"},
        # The engines whose versions the result depends on (the step's cache key: services/pipeline/executor.py).
        options={"tune": search, "tool_engines": sorted({registry().targets[t].engine for t in targets})},
        target=TUNE_TARGET,
        tool="kiln tune",
    )
    publish = PlanStep(
        id="publish:tune",
        kind="publish",
        engine=TUNE_ENGINE,
        entry="services.tune.step:run_tune_publish_step",
        inputs={"model": "tune"},
        options={"name": name, "route": _ROUTE},
        target=TUNE_TARGET,
        tool="repository",
    )
    return Plan(
        source_format=source_format,
        steps=[tune, publish],
        routes={TUNE_TARGET: _ROUTE},
        options={TUNE_TARGET: [RouteOption(_ROUTE, 0.0, export=tune.id, publish=publish.id)]},
        kind="tune",
    )


def replan_tune(plan: Plan, targets: list[str], name: str) -> Plan:
    """Return a tune job's plan again (a resubmission): its search's options over ``targets``, published as ``name``."""
    search = next(s for s in plan.steps if s.kind == "tune")
    # As POST /tune checks them: an edited spec may name a target the search cannot take.
    options = load_tune_options({**search.options["tune"], "targets": targets})
    return plan_tune(plan.source_format, options, targets, name)
