"""Per-target results from step outcomes: shared by the in-process compile and the service.

Both orchestrations (services.pipeline.local for `kiln compile`, services.jobs for the
queued service) skip the dependents of a failed step and then read each target's result
off its export and publish steps; keeping that here means both report the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.graph.planner import Plan, PlanStep, RouteOption
from services.pipeline.fallback import all_routes_failed, route_step_ids, routing

__all__ = ["TargetResult", "blocked_by", "published_input", "target_results", "target_step_ids"]

T = TypeVar("T")


@dataclass
class TargetResult:
    """How one target ended."""

    target: str
    route: str
    status: str = "pending"  # succeeded | failed | skipped
    error: dict[str, Any] | None = None
    parity: dict[str, Any] | None = None
    benchmark: list[dict[str, Any]] = field(default_factory=list)
    #: fp16/int8 against fp32 on the same engine, timed side by side: rows, verdict, which to deploy.
    vs_fp32: dict[str, Any] | None = None
    #: the artifact's task metric on the spec's labelled data against the source's (spec.evaluation)
    evaluation: dict[str, Any] | None = None
    published: dict[str, Any] | None = None
    artifact: str | None = None
    warnings: list[str] = field(default_factory=list)  # fallbacks the export took (also in the manifest)
    attempts: list[dict[str, Any]] = field(default_factory=list)  # each route tried, in order
    #: Where a GPU-bound artifact was checked: the GPU and its numbers, or why on the CPU only (None: not GPU-bound).
    device_check: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def blocked_by(step: PlanStep, failed: Mapping[str, T]) -> T | None:
    """Return the failure of the first step ``step`` waits for that failed, or None when none did."""
    for dep in step.depends_on:
        if dep in failed:
            return failed[dep]
    return None


def target_step_ids(plan: Plan, target: str) -> list[str]:
    """Return the ids of every step a target's first-choice route needs, in plan order (shared steps included)."""
    return route_step_ids(plan, plan.route_options(target)[0])


def published_input(plan: Plan, option: RouteOption) -> str:
    """Return the id of the step whose artifact a route publishes: its GPU check when it has one, else its export."""
    try:
        return plan.step(option.publish).inputs.get("model", option.export)
    except KeyError:
        return option.export


def target_results(
    plan: Plan,
    metas: Mapping[str, dict[str, Any]],
    artifacts: Mapping[str, str | None],
    errors: Mapping[str, dict[str, Any]],
    status: Mapping[str, str] | None = None,
) -> dict[str, TargetResult]:
    """Return each target's result from the finished steps' ``metas``/``artifacts`` and the ``errors`` of failed ones.

    A target succeeded when the publish step of one of its routes did; its route is that
    one. Otherwise its error is its last route's failure, or, when it tried several, one
    error naming every attempt. ``status`` is each step's state (derived from ``metas``
    and ``errors`` when not given: a step with a meta succeeded, one with an error failed).
    """
    if status is None:
        status = {**{sid: "failed" for sid in errors}, **{sid: "succeeded" for sid in metas}}
    routes = routing(plan, status, errors)
    results = {}
    for target, r in routes.items():
        index = r.winner if r.winner is not None else max(len(r.tried) - 1, 0)
        option = r.options[index]
        result = TargetResult(target=target, route=option.route, attempts=[a.to_dict() for a in r.tried])
        results[target] = result
        checked = published_input(plan, option)
        if option.export in metas:
            # The GPU check's meta when it ran (its parity, benchmark and device), else the export's.
            meta = metas.get(checked) or metas[option.export]
            result.parity = meta.get("parity")
            result.benchmark = meta.get("benchmark", [])
            result.warnings = list(meta.get("warnings", []))
            result.vs_fp32 = meta.get("vs_fp32")
            result.device_check = meta.get("device_check")
            result.evaluation = meta.get("evaluation")
            result.artifact = artifacts.get(option.export)
        if r.winner is not None:
            result.status = "succeeded"
            result.published = metas[option.publish].get("published")
            continue
        last = r.tried[-1] if r.tried else None
        err = (last.error if last else None) or errors.get(option.publish)
        result.status = "failed"
        result.error = all_routes_failed(r) or err or {"code": "INTERNAL", "message": "step did not run"}
        if err is not None and "parity" in (err.get("details") or {}):
            result.parity = err["details"]["parity"]
        if err is not None and "evaluation" in (err.get("details") or {}):
            result.evaluation = err["details"]["evaluation"]
    return results
