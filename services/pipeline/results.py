"""Per-target results from step outcomes: shared by the in-process compile and the service.

Both orchestrations (services.pipeline.local for `kiln compile`, services.jobs for the
queued service) skip the dependents of a failed step and then read each target's result
off its export and publish steps; keeping that here means both report the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.graph.planner import Plan, PlanStep

__all__ = ["TargetResult", "blocked_by", "target_results", "target_step_ids"]

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
    published: dict[str, Any] | None = None
    artifact: str | None = None
    warnings: list[str] = field(default_factory=list)  # fallbacks the export took (also in the manifest)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def blocked_by(step: PlanStep, failed: Mapping[str, T]) -> T | None:
    """Return the failure of the first step ``step`` waits for that failed, or None when none did."""
    for dep in step.depends_on:
        if dep in failed:
            return failed[dep]
    return None


def target_step_ids(plan: Plan, target: str) -> list[str]:
    """Return the ids of every step a target depends on, in plan order (shared steps included)."""
    by_id = {s.id: s for s in plan.steps}
    needed: set[str] = set()
    frontier = [f"publish:{target}"]
    while frontier:
        sid = frontier.pop()
        if sid in needed or sid not in by_id:
            continue
        needed.add(sid)
        frontier.extend(by_id[sid].depends_on)
    return [s.id for s in plan.steps if s.id in needed]


def target_results(
    plan: Plan,
    metas: Mapping[str, dict[str, Any]],
    artifacts: Mapping[str, str | None],
    errors: Mapping[str, dict[str, Any]],
) -> dict[str, TargetResult]:
    """Return each target's result from the finished steps' ``metas``/``artifacts`` and the ``errors`` of failed ones.

    A target succeeded when its publish step did; otherwise its error is the publish step's
    recorded failure (a skipped publish carries the failure that blocked it).
    """
    results = {t: TargetResult(target=t, route=r) for t, r in plan.routes.items()}
    for target, result in results.items():
        export_id, publish_id = f"export:{target}", f"publish:{target}"
        if export_id in metas:
            meta = metas[export_id]
            result.parity = meta.get("parity")
            result.benchmark = meta.get("benchmark", [])
            result.warnings = list(meta.get("warnings", []))
            result.vs_fp32 = meta.get("vs_fp32")
            result.artifact = artifacts.get(export_id)
        if publish_id in metas:
            result.status = "succeeded"
            result.published = metas[publish_id].get("published")
        else:
            err = errors.get(publish_id)
            result.status = "failed"
            result.error = err or {"code": "INTERNAL", "message": "step did not run"}
            if err is not None and "parity" in (err.get("details") or {}):
                result.parity = err["details"]["parity"]
    return results
