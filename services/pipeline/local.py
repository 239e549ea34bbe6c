"""Compile in this process: plan, then run every step in order through the executor.

This is what `kiln compile` calls. A target whose step fails is reported with its error
code; the job's other targets go on, since they share nothing after their common prefix.
When a target's route fails in a way another route may avoid, its next route runs
(services/pipeline/fallback.py), and a ``route_failed`` event says which failed and why.
"""

from __future__ import annotations

import re
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.errors import KilnError
from services.formats import DetectedSource, Format, open_source, sha256_path
from services.graph.device_checks import device_bound, gpu_engine, plans_device_checks
from services.graph.engines import ENGINES, installed_engines
from services.graph.planner import Plan, PlanStep, plan_routes
from services.pipeline.executor import StepOutcome, run_step
from services.pipeline.fallback import TargetRouting, needed_steps, route_failed_event, route_failures, routing
from services.pipeline.results import TargetResult, blocked_by, target_results
from services.repository.base import ModelRepository
from services.spec import CompileSpec
from services.steps.context import Progress
from services.steps.source_memo import job_memo
from services.storage.base import ArtifactStore
from services.validation.onnx_source import check_onnx_inputs

__all__ = ["CompileResult", "TargetResult", "compile_model", "default_model_name", "local_engines"]

Event = dict[str, Any]


@dataclass
class CompileResult:
    """The whole job: its plan, each step's outcome and each target's result."""

    job_id: str
    source: DetectedSource
    plan: Plan
    steps: dict[str, StepOutcome]
    targets: dict[str, TargetResult]

    @property
    def ok(self) -> bool:
        return all(t.status == "succeeded" for t in self.targets.values())


def _local_gpu(spec: CompileSpec) -> list[str]:
    """Return the GPU engine when this process can run it and some target needs it (probing costs an NVML call)."""
    if not any(device_bound(t.value, spec) for t in spec.targets):
        return []
    name = gpu_engine(spec)
    return [name] if ENGINES[name].is_installed() else []


def default_model_name(path: Path) -> str:
    """Return a repository-safe model name from a file name (``ResNet 50.onnx`` → ``ResNet_50``)."""
    stem = path.name.split(".")[0] if path.is_file() else path.name
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem).strip("_.-") or "model"
    return name[:128]


def _progress_to(emit: Callable[[Event], None], step_id: str) -> Callable[[Progress], None]:
    """Return the progress callback of step ``step_id``: each message becomes a progress event."""

    def progress(message: Progress) -> None:
        if isinstance(message, dict):
            emit({"type": "progress", "step": step_id, **message})
        else:
            emit({"type": "progress", "step": step_id, "message": message})

    return progress


def _next_step(plan: Plan, routes: dict[str, TargetRouting], status: dict[str, str]) -> PlanStep | None:
    """Return the first pending step (plan order) a route in progress needs whose inputs are done or failed."""
    now, _ = needed_steps(plan, routes)
    for step in plan.steps:
        if status[step.id] == "pending" and step.id in now:
            if all(status[d] != "pending" for d in step.depends_on):
                return step
    return None


def local_engines() -> set[str]:
    """Return the engines this process can run steps on: those whose SDKs are installed here."""
    return {e.name for e in installed_engines()}


def compile_model(
    model_path: Path,
    spec: CompileSpec,
    *,
    store: ArtifactStore,
    repository: ModelRepository | None,
    on_event: Callable[[Event], None] | None = None,
    use_cache: bool = True,
    job_id: str | None = None,
) -> CompileResult:
    """Plan and run a whole job in this process; return per-target results (never raises per target)."""
    emit = on_event or (lambda e: None)
    job_id = job_id or uuid.uuid4().hex[:12]
    # The whole job holds the store: a prune between two steps would drop what the next reads.
    # Its steps share one load of the source model (services/steps/source_memo.py).
    with store.in_use(), job_memo(), tempfile.TemporaryDirectory(prefix="kiln-job-") as tmp:
        scratch = Path(tmp)
        source = open_source(Path(model_path), scratch, spec.source_format)
        # In-process, the GPU check runs here when this machine has the GPU engine (a GPU and onnxruntime-gpu).
        gpu = plans_device_checks(spec, _local_gpu(spec))
        plan = plan_routes(
            source.format,
            spec,
            default_name=default_model_name(Path(model_path)),
            engines=local_engines(),
            gpu_worker=gpu,
        )
        if source.format is Format.ONNX:  # what the API refuses at submission, refused here before any step
            check_onnx_inputs(source.path, spec)
        emit({"type": "planned", "plan": plan.to_dict(), "source": source.seen})
        calibration_path = Path(spec.calibration) if spec.calibration else None
        calibration_sha = sha256_path(calibration_path) if calibration_path and calibration_path.exists() else None
        evaluation_path = Path(spec.evaluation.data) if spec.evaluation else None
        evaluation_sha = sha256_path(evaluation_path) if evaluation_path and evaluation_path.is_file() else None
        outcomes: dict[str, StepOutcome] = {}
        failed: dict[str, KilnError] = {}
        status = {s.id: "pending" for s in plan.steps}
        errors: dict[str, dict[str, Any]] = {}
        routes = routing(plan, status, errors)

        def run(step: PlanStep) -> StepOutcome | KilnError:
            emit({"type": "step_started", "step": step.id, "kind": step.kind, "engine": step.engine})
            keys = {role: outcomes[dep].key or "" for role, dep in step.inputs.items() if dep != "source"}
            attempts = routes[step.target].attempts if step.kind == "publish" and step.target else None
            try:
                outcome = run_step(
                    step,
                    job_id=job_id,
                    spec=spec,
                    source=source,
                    input_keys=keys,
                    store=store,
                    scratch=scratch / "steps" / str(len(outcomes) + len(failed)),
                    repository=repository,
                    on_progress=_progress_to(emit, step.id),
                    calibration_path=calibration_path,
                    calibration_sha=calibration_sha,
                    evaluation_path=evaluation_path,
                    evaluation_sha=evaluation_sha,
                    use_cache=use_cache,
                    route_attempts=[a.to_dict() for a in attempts if a.status != "not tried"] if attempts else None,
                )
            except KilnError as exc:
                emit({"type": "step_failed", "step": step.id, "error": exc.to_dict()})
                return exc
            emit(
                {
                    "type": "step_finished",
                    "step": step.id,
                    "seconds": round(outcome.seconds, 3),
                    "cached": outcome.cached,
                }
            )
            return outcome

        while (step := _next_step(plan, routes, status)) is not None:
            blocker = blocked_by(step, failed)
            if blocker is not None:
                failed[step.id], errors[step.id], status[step.id] = blocker, blocker.to_dict(), "skipped"
                emit({"type": "step_skipped", "step": step.id, "because": blocker.code})
            else:
                outcome = run(step)
                if isinstance(outcome, KilnError):
                    failed[step.id], errors[step.id], status[step.id] = outcome, outcome.to_dict(), "failed"
                else:
                    outcomes[step.id], status[step.id] = outcome, "succeeded"
            before, routes = routes, routing(plan, status, errors)
            for target, attempt, nxt in route_failures(before, routes):
                emit(route_failed_event(target, attempt, nxt))
        targets = target_results(
            plan,
            {sid: o.meta for sid, o in outcomes.items()},
            {sid: str(o.artifact.path) for sid, o in outcomes.items()},
            errors,
            status,
        )
        emit({"type": "finished", "ok": all(t.status == "succeeded" for t in targets.values())})
        return CompileResult(job_id=job_id, source=source, plan=plan, steps=outcomes, targets=targets)
