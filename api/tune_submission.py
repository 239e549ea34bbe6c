"""Accept a tune (POST /tune): the upload as POST /compile takes it, planned as one search step.

The upload, its vetting, the tenant's names, idempotency and webhooks are POST /compile's
(api/submission.py); what differs is the plan (services/tune/plan.py) and the targets: those
the ``tune`` part names, else every CPU target with a settings grid that a live tune worker runs.
"""

from __future__ import annotations

import json
from collections.abc import Collection

from api.submission import Planner
from services.descriptors import registry
from services.errors import EngineUnavailable, InvalidSpec
from services.formats import DetectedSource
from services.graph.planner import Plan
from services.jobs.worker_registry import WorkerRegistry
from services.spec import CompileSpec
from services.tune.options import TuneOptions, load_tune_options
from services.tune.plan import TUNE_ENGINE, plan_tune
from services.tune.space import TUNABLE_TARGETS, default_targets

__all__ = ["BUDGET_SHARE", "prepare_tune", "tune_worker_engines"]

#: The share of the step time limit a tune may spend at most (the rest: publishing, stopping cleanly).
BUDGET_SHARE = 0.8


def tune_worker_engines(workers: WorkerRegistry, max_age: float | None) -> set[str]:
    """Return the engines the live tune workers run (a `--engine tune` worker lists them in its versions)."""
    if max_age is None:
        return set()
    return {
        e.split("-")[0]
        for w in workers.live_workers(max_age)
        if TUNE_ENGINE in w.engines
        for e in [*w.engines, *w.versions]
    }


def _targets(
    options: TuneOptions, live_engines: Collection[str] | None, runs: set[str], wait: bool = False
) -> list[str]:
    """Return the targets to search: the options', else the default ones the live tune workers run.

    ``runs``: the engines of live tune workers (empty while `kiln serve`'s own worker is still
    starting: then the ones installed here, which are what it will run).
    """
    if options.targets:
        return list(options.targets)
    known = registry().targets
    if runs:
        return [t for t in TUNABLE_TARGETS if t in known and known[t].engine in runs]
    if live_engines is None or TUNE_ENGINE in live_engines or wait:  # wait: the job queues for a tune worker
        return default_targets()
    raise EngineUnavailable(
        "no live worker takes tune jobs (one that runs two or more of onnxruntime, openvino, tensorflow)",
        hint="Start `kiln serve`, or `kiln worker --engine tune` in an image with those engines (worker-tune).",
        engines=[TUNE_ENGINE],
    )


def prepare_tune(
    fields: dict[str, str],
    *,
    live_engines: Collection[str] | None,
    tune_engines: set[str],
    step_time_limit: float,
) -> Planner:
    """Return the planner of the tune's job; set ``fields["spec"]`` to the spec it runs with.

    The ``spec`` part is optional here (a CompileSpec's shared fields: inputs, tolerances,
    calibration...); its ``targets`` become the searched ones. The budget is capped at
    ``BUDGET_SHARE`` of ``step_time_limit``, so the search stops on its own before the step is stopped.
    """
    options = load_tune_options(fields.get("tune"))
    try:
        spec_data = json.loads(fields.get("spec") or "{}")
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidSpec(f"spec is not readable JSON: {exc}") from exc
    if not isinstance(spec_data, dict):
        raise InvalidSpec("spec must be a JSON object")
    targets = _targets(options, live_engines, tune_engines, wait=spec_data.get("wait_for_workers") is True)
    if not targets:
        raise InvalidSpec("the tune has no target to search", hint='Name them: {"targets": ["onnxruntime", ...]}.')
    cap = step_time_limit * BUDGET_SHARE
    options = options.model_copy(update={"targets": targets, "budget_s": min(options.budget_s or cap, cap)})
    fields["spec"] = json.dumps({**spec_data, "targets": targets})

    def planner(source: DetectedSource, spec: CompileSpec, default_name: str) -> Plan:
        return plan_tune(source.format, options, targets, spec.name or default_name)

    return planner
