"""The search, in order: build (pruning what fails parity), expand into settings, time side by side, choose, profile, publish."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.descriptors import registry
from services.errors import InvalidSpec
from services.formats import Format, open_source
from services.pipeline import compile_model
from services.repository.base import ModelRepository
from services.spec import CompileSpec, load_spec
from services.storage.base import ArtifactStore
from services.tune.budget import Deadline
from services.tune.build import build_artifacts
from services.tune.concurrency import CONCURRENCY, measure_concurrency
from services.tune.manifest import record_tune, tune_section
from services.tune.measure import measure_candidates
from services.tune.profile import PROFILED_TARGETS, profile_candidate
from services.tune.recommend import OBJECTIVES, recommend
from services.tune.report import Built, Candidate, TuneReport
from services.tune.space import default_targets, settings_grid, triton_serving

__all__ = ["TuneRequest", "expand_candidates", "tune_model"]

Event = dict[str, Any]

#: What the ``tune_recommendation`` event says (the report has the rest).
_RECOMMENDATION_FIELDS = ("id", "target", "precision", "settings", "batch", "p50_ms", "p99_ms", "margin", "verdict")


@dataclass
class TuneRequest:
    """What to search and against which goals."""

    model: Path
    objective: str = "latency"
    batches: list[int] = field(default_factory=lambda: [1])
    max_p99_ms: float | None = None
    targets: list[str] | None = None  # None: default_targets()
    precisions: list[str] = field(default_factory=lambda: ["fp32", "fp16", "int8"])
    budget_s: float | None = None
    #: CompileSpec fields every build shares (inputs, tolerances, calibration, validation...).
    spec_data: dict[str, Any] = field(default_factory=dict)
    rounds: int = 50
    warmup: int = 5
    profile: bool = True
    profile_runs: int = 20
    name: str | None = None  # the published name (with a repository)
    use_cache: bool = True
    cpus: int | None = None  # thread counts to try go up to this (default: the machine's)
    #: Stop timing candidates that cannot win (services/tune/race.py); False times all for every round.
    race: bool = True
    #: Throughput objective: concurrent requests (one instance each) the recommendation is measured at.
    concurrency: list[int] = field(default_factory=lambda: list(CONCURRENCY))
    concurrency_rounds: int = 5
    concurrency_requests: int = 8  # at least, per instance and round (services/tune/concurrency.py)
    concurrency_round_s: float = 0.05  # about how long one instance's round lasts

    def check(self) -> None:
        """Raise INVALID_SPEC for an objective, batch or target the search cannot take."""
        if self.objective not in OBJECTIVES:
            raise InvalidSpec(f"unknown objective {self.objective!r}", hint="Use one of: " + ", ".join(OBJECTIVES))
        if not self.batches or any(b < 1 for b in self.batches):
            raise InvalidSpec(f"batch sizes must be positive: {self.batches}", hint="e.g. --batch 1,8")
        known = registry().targets
        unknown = [t for t in self.targets or [] if t not in known]
        if unknown:
            raise InvalidSpec(f"unknown targets {unknown}", hint="Known: " + ", ".join(known))
        if self.max_p99_ms is not None and self.max_p99_ms <= 0:
            raise InvalidSpec("--max-p99-ms must be positive")
        if self.rounds < 1:
            raise InvalidSpec("rounds must be at least 1")
        if not self.concurrency or min(self.concurrency) < 1 or max(self.concurrency) > 64:
            raise InvalidSpec(f"concurrency levels must be 1 to 64: {self.concurrency}")
        if self.concurrency_rounds < 1 or self.concurrency_requests < 1:
            raise InvalidSpec("concurrency rounds and requests must be at least 1")


def expand_candidates(built: list[Built], batches: list[int], objective: str, cpus: int | None) -> list[Candidate]:
    """Return one candidate per built artifact × its engine's settings × batch; one (untimed) row per pruned build."""
    out = []
    for b in built:
        if b.status != "built":
            reason = (b.error or {}).get("message") or b.status
            out.append(
                Candidate(
                    b.target,
                    b.precision,
                    {},
                    batches[0],
                    passed=False,
                    status=b.status,
                    parity=b.parity,
                    evaluation=b.evaluation,
                    reason=f"{(b.error or {}).get('code')}: {reason}"[:500],
                )
            )
            continue
        for settings in settings_grid(b.target, objective, cpus):
            for batch in batches:
                out.append(
                    Candidate(
                        b.target,
                        b.precision,
                        dict(settings),
                        batch,
                        passed=False,
                        status="timed",
                        artifact=b.artifact,
                        artifact_bytes=b.artifact_bytes,
                        parity=b.parity,
                        warnings=list(b.warnings),
                        evaluation=b.evaluation,
                    )
                )
    return out


def _publish(
    req: TuneRequest, rec: dict[str, Any], store: ArtifactStore, repository: ModelRepository
) -> dict[str, Any] | None:
    """Publish the recommended (target, precision) through the pipeline (its export comes from the cache)."""
    data = {**req.spec_data, "targets": [rec["target"]], "precision": rec["precision"], "benchmark": False}
    serving = dict(req.spec_data.get("serving") or {})
    serving["triton"] = {**(serving.get("triton") or {}), **rec["serving"]["triton"]}
    data["serving"] = serving
    if req.name:
        data["name"] = req.name
    result = compile_model(req.model, load_spec(data), store=store, repository=repository, use_cache=req.use_cache)
    target = result.targets[rec["target"]]
    if target.status != "succeeded":
        return {"error": target.error}
    return target.published


def _serving_pick(
    req: TuneRequest,
    rec: dict[str, Any],
    chosen: Candidate,
    formats: dict[str, str],
    spec: CompileSpec,
    deadline: Deadline,
    emit: Callable[[Event], None],
) -> dict[str, Any]:
    """Return how to serve the recommendation: batch, instances and the spec's ``serving.triton`` for them.

    For the throughput objective, the batch and instance count are the best point of the
    throughput-vs-concurrency curve measured for the recommendation (``curve``); otherwise
    one instance at the recommendation's batch, as the latency was measured.
    """
    batch, instances, curve = chosen.batch, 1, None
    if req.objective == "throughput":
        emit({"type": "tune_concurrency", "candidate": chosen.key, "levels": req.concurrency, "batches": req.batches})
        curve = measure_concurrency(
            chosen,
            formats[chosen.target],
            spec,
            batches=req.batches,
            deadline=deadline,
            concurrency=req.concurrency,
            rounds=req.concurrency_rounds,
            requests=req.concurrency_requests,
            warmup=min(req.warmup, 2),
            min_round_s=req.concurrency_round_s,
        )
        if curve["pick"] is not None:
            batch, instances = curve["pick"]["batch"], curve["pick"]["instances"]
    return {
        "batch": batch,
        "instances": instances,
        "basis": "throughput-vs-concurrency curve" if curve else "one request at a time, as timed",
        "throughput": curve["pick"]["throughput"] if curve and curve["pick"] else chosen.throughput,
        "curve": curve,
        "triton": triton_serving(chosen.target, chosen.settings, batch, instances),
    }


def tune_model(
    req: TuneRequest,
    *,
    store: ArtifactStore,
    repository: ModelRepository | None = None,
    on_event: Callable[[Event], None] | None = None,
) -> TuneReport:
    """Search ``req``'s space and return the report; publishes the recommendation when ``repository`` is given."""
    req.check()
    deadline = Deadline(req.budget_s)
    emit = on_event or (lambda e: None)
    targets = list(req.targets or default_targets())
    if not targets:
        raise InvalidSpec("no CPU target with a settings grid is installed here", hint="Give --targets.")
    with tempfile.TemporaryDirectory(prefix="kiln-tune-") as tmp:
        override = req.spec_data.get("source_format")
        source_format = open_source(req.model, Path(tmp), Format(override) if override else None).format.value
    builds = build_artifacts(
        req.model,
        req.spec_data,
        targets,
        req.precisions,
        source_format,
        store=store,
        deadline=deadline,
        use_cache=req.use_cache,
        on_event=emit,
    )
    candidates = expand_candidates(builds.built, req.batches, req.objective, req.cpus)
    formats = {b.target: b.artifact_format for b in builds.built if b.artifact_format}
    spec = load_spec({**req.spec_data, "targets": [targets[0]]})
    emit({"type": "tune_measure", "candidates": sum(c.status == "timed" for c in candidates)})
    emit({"type": "tune_candidates", "phase": "expanded", "candidates": [c.summary() for c in candidates]})
    measurement = measure_candidates(
        candidates,
        formats,
        spec,
        rounds=req.rounds,
        warmup=req.warmup,
        deadline=deadline,
        max_p99_ms=req.max_p99_ms,
        racing_enabled=req.race and req.objective != "size",
    )
    stopped = builds.stopped
    if measurement.get("stopped_by_budget"):
        stopped = (stopped + "; " if stopped else "") + (
            f"budget spent during timing: {measurement['rounds']} of {req.rounds} rounds run"
        )
    emit({"type": "tune_candidates", "phase": "timed", "candidates": [c.summary() for c in candidates]})
    rec = recommend(candidates, req.objective, req.max_p99_ms)
    by_key = {c.key: c for c in candidates}
    if rec is not None:
        rec["serving"] = _serving_pick(req, rec, by_key[rec["id"]], formats, spec, deadline, emit)
    profiles: dict[str, Any] = {}
    notes = []
    if rec is not None and req.profile:
        chosen = [rec["id"]] + ([rec["runner_up"]["id"]] if rec.get("runner_up") else [])
        for role, key in zip(("recommendation", "runner_up"), chosen, strict=False):
            c = by_key[key]
            profiles[role] = profile_candidate(c, formats[c.target], spec, runs=req.profile_runs)
        # Engines without a profiler wired (tflite) can win; the fastest artifact of each engine that
        # has one is profiled too, so the report always shows where time goes on those engines.
        for engine in PROFILED_TARGETS:
            if any(p.get("target") == engine and p.get("available") for p in profiles.values()):
                continue
            best = min(
                (c for c in candidates if c.target == engine and c.meets_constraints),
                key=lambda c: c.p50_ms or 0.0,
                default=None,
            )
            if best is not None:
                profiles[f"best_{engine}"] = profile_candidate(best, formats[engine], spec, runs=req.profile_runs)
        rec["profile"] = profiles.get("recommendation")
    if rec is not None:
        emit({"type": "tune_recommendation", **{k: rec.get(k) for k in _RECOMMENDATION_FIELDS}})
    if rec is None:
        notes.append("no candidate met every constraint" if any(c.passed for c in candidates) else "nothing was timed")
    published = None
    if rec is not None and repository is not None:
        published = _publish(req, rec, store, repository)
        if published and "error" not in published:
            where = record_tune(repository, published, tune_section(rec, profiles, measurement))
            published["manifest_tune"] = where
        notes.append(
            "published the recommended artifact with the tune in its manifest; its Triton config (if the target has "
            "one) carries the measured engine settings, instance count and batch"
        )
    return TuneReport(
        model=str(req.model),
        objective=req.objective,
        batches=req.batches,
        max_p99_ms=req.max_p99_ms,
        targets=targets,
        precisions=req.precisions,
        candidates=candidates,
        recommendation=rec,
        built=builds.built,
        cache=builds.cache(),
        measurement=measurement,
        profiles=profiles,
        wall_s=deadline.elapsed(),
        budget_s=req.budget_s,
        stopped_early=stopped,
        published=published,
        notes=notes,
    )
