"""What a tune found: every candidate (timed, pruned or failed) and the recommendation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Built", "Candidate", "TuneReport"]

_SUMMARY_FIELDS = (
    "target",
    "precision",
    "settings",
    "batch",
    "status",
    "passed",
    "meets_constraints",
    "p50_ms",
    "p99_ms",
    "iqr_ms",
    "throughput",
    "artifact_bytes",
)


@dataclass
class Built:
    """One (target, precision) artifact from the compile pipeline, or why there is none."""

    target: str
    precision: str
    status: str  # built | pruned (failed parity or the accuracy floor) | failed (another error) | skipped (budget)
    artifact: str | None = None
    artifact_format: str | None = None
    artifact_bytes: int | None = None
    parity: dict[str, Any] | None = None  # passed, worst SNR (dB), failures
    error: dict[str, Any] | None = None  # code and message when not built
    #: What the export warned about (int8 calibrated on generated samples, a fixed-shape fallback).
    warnings: list[str] = field(default_factory=list)
    #: Its score on the spec's labelled data against the source's (metric, artifact, source, drop, passed).
    evaluation: dict[str, Any] | None = None


@dataclass
class Candidate:
    """One artifact under one set of engine settings at one batch size, and its timing."""

    target: str
    precision: str
    settings: dict[str, Any]
    batch: int
    passed: bool  # built, passed parity, and timed
    status: str  # timed | pruned | failed | skipped
    artifact: str | None = None
    artifact_bytes: int | None = None
    parity: dict[str, Any] | None = None
    reason: str | None = None  # why it was not timed
    warnings: list[str] = field(default_factory=list)  # the build's warnings
    evaluation: dict[str, Any] | None = None  # the build's accuracy on the labelled data (the floor it met)
    p50_ms: float | None = None
    p99_ms: float | None = None
    p25_ms: float | None = None
    p75_ms: float | None = None
    iqr_ms: float | None = None
    #: Bootstrap 95% interval of the p50 (seeded resampling of the rounds).
    p50_ci_ms: list[float] | None = None
    mean_ms: float | None = None
    throughput: float | None = None  # samples/s over the timed runs (one synchronous request)
    rounds: int = 0
    meets_constraints: bool = False
    violations: list[str] = field(default_factory=list)
    #: Per-round seconds (kept for the paired comparison; not in the JSON).
    times: list[float] = field(default_factory=list, repr=False)

    @property
    def key(self) -> str:
        flat = ",".join(f"{k}={v}" for k, v in sorted(self.settings.items()))
        return f"{self.target}/{self.precision}/b{self.batch}/{flat}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("times")
        d["id"] = self.key
        return d

    def summary(self) -> dict[str, Any]:
        """Return the candidate's row as a live page shows it (no warnings, parity failures or CI)."""
        parity = self.parity or {}
        return {
            "id": self.key,
            **{k: getattr(self, k) for k in _SUMMARY_FIELDS},
            "min_snr_db": parity.get("min_snr_db"),
            "accuracy": (self.evaluation or {}).get("artifact"),
            "reason": (self.reason or "")[:200] or None,
        }


@dataclass
class TuneReport:
    """The whole search: its inputs, the candidates, the recommendation, and how the search went."""

    model: str
    objective: str
    batches: list[int]
    max_p99_ms: float | None
    targets: list[str]
    precisions: list[str]
    candidates: list[Candidate]
    recommendation: dict[str, Any] | None
    built: list[Built]
    cache: dict[str, Any]
    measurement: dict[str, Any]
    profiles: dict[str, Any]
    wall_s: float
    budget_s: float | None
    stopped_early: str | None = None
    published: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.recommendation is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "objective": self.objective,
            "batches": self.batches,
            "max_p99_ms": self.max_p99_ms,
            "targets": self.targets,
            "precisions": self.precisions,
            "candidates": [c.to_dict() for c in self.candidates],
            "recommendation": self.recommendation,
            "built": [asdict(b) for b in self.built],
            "cache": self.cache,
            "measurement": self.measurement,
            "profiles": self.profiles,
            "wall_s": round(self.wall_s, 3),
            "budget_s": self.budget_s,
            "stopped_early": self.stopped_early,
            "published": self.published,
            "notes": self.notes,
        }
