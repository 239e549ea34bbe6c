"""Compile in this process: plan, then run every step in order through the executor.

This is what `kiln compile` calls. A target whose step fails is reported with its error
code; the job's other targets go on, since they share nothing after their common prefix.
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
from services.formats import DetectedSource, open_source, sha256_path
from services.graph.planner import Plan, plan_routes
from services.pipeline.executor import StepOutcome, run_step
from services.pipeline.results import TargetResult, blocked_by, target_results
from services.repository.base import ModelRepository
from services.spec import CompileSpec
from services.storage.base import ArtifactStore

__all__ = ["CompileResult", "TargetResult", "compile_model", "default_model_name"]

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


def default_model_name(path: Path) -> str:
    """Return a repository-safe model name from a file name (``ResNet 50.onnx`` → ``ResNet_50``)."""
    stem = path.name.split(".")[0] if path.is_file() else path.name
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem).strip("_.-") or "model"
    return name[:128]


def _progress_to(emit: Callable[[Event], None], step_id: str) -> Callable[[str], None]:
    """Return the progress callback of step ``step_id``: each message becomes a progress event."""

    def progress(message: str) -> None:
        emit({"type": "progress", "step": step_id, "message": message})

    return progress


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
    with store.in_use(), tempfile.TemporaryDirectory(prefix="kiln-job-") as tmp:
        scratch = Path(tmp)
        source = open_source(Path(model_path), scratch, spec.source_format)
        plan = plan_routes(source.format, spec, default_name=default_model_name(Path(model_path)))
        emit({"type": "planned", "plan": plan.to_dict(), "source": source.seen})
        calibration_path = Path(spec.calibration) if spec.calibration else None
        calibration_sha = sha256_path(calibration_path) if calibration_path and calibration_path.exists() else None
        outcomes: dict[str, StepOutcome] = {}
        failed: dict[str, KilnError] = {}
        for step in plan.steps:
            blocker = blocked_by(step, failed)
            if blocker is not None:
                failed[step.id] = blocker
                emit({"type": "step_skipped", "step": step.id, "because": blocker.code})
                continue
            emit({"type": "step_started", "step": step.id, "kind": step.kind, "engine": step.engine})
            keys = {role: outcomes[dep].key or "" for role, dep in step.inputs.items() if dep != "source"}
            try:
                outcome = run_step(
                    step,
                    job_id=job_id,
                    spec=spec,
                    source=source,
                    input_keys=keys,
                    store=store,
                    scratch=scratch / "steps" / str(len(outcomes)),
                    repository=repository,
                    on_progress=_progress_to(emit, step.id),
                    calibration_path=calibration_path,
                    calibration_sha=calibration_sha,
                    use_cache=use_cache,
                )
            except KilnError as exc:
                failed[step.id] = exc
                emit({"type": "step_failed", "step": step.id, "error": exc.to_dict()})
                continue
            outcomes[step.id] = outcome
            emit(
                {
                    "type": "step_finished",
                    "step": step.id,
                    "seconds": round(outcome.seconds, 3),
                    "cached": outcome.cached,
                }
            )
        targets = target_results(
            plan,
            {sid: o.meta for sid, o in outcomes.items()},
            {sid: str(o.artifact.path) for sid, o in outcomes.items()},
            {sid: e.to_dict() for sid, e in failed.items()},
        )
        emit({"type": "finished", "ok": all(t.status == "succeeded" for t in targets.values())})
        return CompileResult(job_id=job_id, source=source, plan=plan, steps=outcomes, targets=targets)
