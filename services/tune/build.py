"""Build each (target, precision) artifact once with the compile pipeline, and prune what fails parity.

One ``compile_model`` call per precision builds every target at it; the step cache makes the
calls share their conversions and the reference outputs (the first call runs them, the others
reuse them), which :func:`build_artifacts` counts. The artifacts are published into a scratch
repository only (the recommendation is published for real afterwards).

Pruning: a (target, precision) that fails parity, or loses more than ``evaluation.max_drop`` on
the spec's labelled data (the accuracy floor), is not expanded into settings; a target whose fp32
artifact fails is not built at a riskier precision.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.artifacts import Artifact
from services.errors import KilnError
from services.pipeline import compile_model
from services.repository.local import LocalModelRepository
from services.spec import load_spec
from services.storage.base import ArtifactStore
from services.tune.budget import Deadline
from services.tune.report import Built
from services.tune.space import precisions_for

__all__ = ["PRUNING_CODES", "BuildResult", "build_artifacts", "evaluation_summary", "parity_summary"]

#: A build that fails one of these is pruned (a quality verdict), not failed (an error).
PRUNING_CODES = ("PARITY_FAILED", "ACCURACY_DROP_EXCEEDED")

#: Lowest risk first: a riskier precision is built only where a safer one passed.
PRECISION_ORDER = ("fp32", "fp16", "int8", "int4")

_CONVERSION_KINDS = {"reference", "convert", "optimize"}


class BuildResult:
    """The artifacts built, the cache's reuse across the compile calls, and whether the budget cut the builds."""

    def __init__(self) -> None:
        self.built: list[Built] = []
        self.steps_run = 0
        self.steps_cached = 0
        self.conversions_run = 0
        self.conversions_reused = 0
        self.reused: list[str] = []
        self.stopped: str | None = None

    def cache(self) -> dict[str, Any]:
        total = self.steps_run + self.steps_cached
        return {
            "steps": total,
            "steps_run": self.steps_run,
            "steps_cached": self.steps_cached,
            "hit_rate": round(self.steps_cached / total, 3) if total else 0.0,
            "conversions_run": self.conversions_run,
            "conversions_reused": self.conversions_reused,
            "reused_steps": self.reused,
        }


def parity_summary(parity: dict[str, Any] | None) -> dict[str, Any] | None:
    """Return the parity fields a tune reports: passed, the worst output's SNR, and the failures."""
    if not parity:
        return None
    # to_dict writes a non-finite SNR (a zero signal, a NaN error) as the string "-inf"/"inf".
    snrs = [float(o["snr_db"]) for o in parity.get("outputs", []) if o.get("snr_db") is not None]
    worst = min(snrs) if snrs else None
    return {
        "passed": bool(parity.get("passed")),
        "min_snr_db": round(worst, 2) if worst is not None and math.isfinite(worst) else None,
        "failures": list(parity.get("failures", []))[:5],
    }


def evaluation_summary(evaluation: dict[str, Any] | None) -> dict[str, Any] | None:
    """Return the accuracy fields a tune reports: metric, the artifact's and the source's scores, drop, verdict."""
    if not evaluation or "passed" not in evaluation:
        return None
    keys = ("metric", "artifact", "source", "drop", "max_drop", "passed")
    return {k: evaluation.get(k) for k in keys}


def _payload_bytes(artifact_path: str) -> int | None:
    path = Path(artifact_path)
    root = path if path.is_dir() else path.parent
    try:
        return sum(p.stat().st_size for p in Artifact.load(root).files() if not p.name.startswith(".kiln"))
    except (OSError, KeyError, ValueError):
        return None


def build_artifacts(
    model: Path,
    spec_data: dict[str, Any],
    targets: list[str],
    precisions: list[str],
    source_format: str,
    *,
    store: ArtifactStore,
    deadline: Deadline,
    use_cache: bool = True,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> BuildResult:
    """Build every target at every precision it allows (lowest risk first) until the deadline; prune failures."""
    result = BuildResult()
    emit = on_event or (lambda e: None)
    fp32_failed: set[str] = set()
    ordered = [p for p in PRECISION_ORDER if p in precisions]
    with tempfile.TemporaryDirectory(prefix="kiln-tune-repo-") as scratch:
        repository = LocalModelRepository(Path(scratch))
        for precision in ordered:
            known = len(result.built)
            try:
                wanted = [t for t in targets if precision in precisions_for(t, source_format, [precision])]
                for t in [t for t in wanted if t in fp32_failed]:
                    result.built.append(
                        Built(t, precision, "pruned", error={"code": "PRUNED", "message": "its fp32 artifact failed"})
                    )
                wanted = [t for t in wanted if t not in fp32_failed]
                if not wanted:
                    continue
                if deadline.passed():
                    result.stopped = f"budget spent before building {precision}"
                    result.built.extend(
                        Built(t, precision, "skipped", error={"code": "TIMEOUT", "message": result.stopped})
                        for t in wanted
                    )
                    continue
                emit({"type": "tune_build", "precision": precision, "targets": wanted})
                spec = load_spec({**spec_data, "targets": wanted, "precision": precision, "benchmark": False})
                try:
                    compiled = compile_model(
                        model, spec, store=store, repository=repository, on_event=on_event, use_cache=use_cache
                    )
                except KilnError as exc:  # the whole job refused (planning, the source): nothing of it is built
                    error: dict[str, Any] = {"code": exc.code, "message": str(exc)[:500]}
                    result.built.extend(Built(t, precision, "failed", error=error) for t in wanted)
                    fp32_failed |= set(wanted) if precision == "fp32" else set()
                    continue
                kinds = {s.id: s.kind for s in compiled.plan.steps}
                for sid, outcome in compiled.steps.items():
                    if kinds.get(sid) == "publish":
                        continue  # scratch publishing is not part of the search
                    conversion = kinds.get(sid) in _CONVERSION_KINDS
                    if outcome.cached:
                        result.steps_cached += 1
                        result.conversions_reused += conversion
                        result.reused.append(f"{precision}:{sid}")
                    else:
                        result.steps_run += 1
                        result.conversions_run += conversion
                for target in wanted:
                    tr = compiled.targets[target]
                    code = (tr.error or {}).get("code")
                    summary = parity_summary(tr.parity)
                    accuracy = evaluation_summary(tr.evaluation)
                    if tr.status == "succeeded" and tr.artifact:
                        result.built.append(
                            Built(
                                target,
                                precision,
                                "built",
                                artifact=tr.artifact,
                                artifact_format=registry_format(target),
                                artifact_bytes=_payload_bytes(tr.artifact),
                                parity=summary,
                                warnings=list(tr.warnings),
                                evaluation=accuracy,
                            )
                        )
                        continue
                    status = "pruned" if code in PRUNING_CODES else "failed"
                    if precision == "fp32":
                        fp32_failed.add(target)
                    error = {"code": code, "message": str((tr.error or {}).get("message", ""))[:500]}
                    result.built.append(
                        Built(target, precision, status, parity=summary, error=error, evaluation=accuracy)
                    )
            finally:  # what this precision gave, as it comes (a tune job's page shows it live)
                if len(result.built) > known:
                    emit(
                        {
                            "type": "tune_built",
                            "precision": precision,
                            "built": [asdict(b) for b in result.built[known:]],
                        }
                    )
    return result


def registry_format(target: str) -> str:
    """Return the format of ``target``'s artifacts (what opens them)."""
    from services.descriptors import registry

    return registry().targets[target].artifact_format
