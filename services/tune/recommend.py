"""Choose: the best candidate meeting every constraint, its runner-up, and whether the margin is real.

The margin's noise comes from the paired rounds: candidates were timed in the same rounds
(services/tune/measure.py), so the per-round difference between the runner-up and the
recommendation cancels the load both saw. When the bootstrap 95% interval of the median
difference reaches zero, the margin is within the noise and the report says so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.tune.report import Candidate
from services.tune.stats import bootstrap_ci

__all__ = ["OBJECTIVES", "apply_constraints", "paired_difference", "recommend"]

OBJECTIVES = ("latency", "throughput", "size")


def apply_constraints(candidates: list[Candidate], max_p99_ms: float | None) -> None:
    """Mark each timed candidate with whether it meets the constraints, and which it violates."""
    for c in candidates:
        c.violations = []
        if not c.passed or c.p99_ms is None:
            c.meets_constraints = False
            continue
        if max_p99_ms is not None and c.p99_ms > max_p99_ms:
            c.violations.append(f"p99 {c.p99_ms:.3f} ms > {max_p99_ms:g} ms")
        c.meets_constraints = not c.violations


def _rank_key(objective: str) -> Any:
    if objective == "throughput":
        return lambda c: (-(c.throughput or 0.0), c.p50_ms)
    if objective == "size":
        return lambda c: (c.artifact_bytes if c.artifact_bytes is not None else float("inf"), c.p50_ms)
    return lambda c: (c.p50_ms, c.p99_ms)


def paired_difference(a: Candidate, b: Candidate, per_sample: bool = False) -> dict[str, Any]:
    """Return the median per-round difference ``b - a`` in ms (per sample when ``per_sample``) and its 95% interval."""
    n = min(len(a.times), len(b.times))
    ta = np.asarray(a.times[:n]) * 1e3
    tb = np.asarray(b.times[:n]) * 1e3
    if per_sample:
        ta, tb = ta / a.batch, tb / b.batch
    d = tb - ta
    if n == 0:
        return {"median_ms": None, "ci_ms": None, "rounds": 0}
    return {"median_ms": float(np.median(d)), "ci_ms": bootstrap_ci(d), "rounds": n}


def _margin(objective: str, best: Candidate, other: Candidate) -> float:
    """Return how much better ``best`` is than ``other`` on the objective, as a fraction of ``best``'s figure."""
    if objective == "throughput":
        return (best.throughput or 0.0) / (other.throughput or 1.0) - 1.0
    if objective == "size":
        return (other.artifact_bytes or 0) / (best.artifact_bytes or 1) - 1.0
    return (other.p50_ms or 0.0) / (best.p50_ms or 1.0) - 1.0


def _within_noise(objective: str, best: Candidate, other: Candidate) -> tuple[bool, dict[str, Any] | None]:
    if objective == "size":
        return best.artifact_bytes == other.artifact_bytes, None
    diff = paired_difference(best, other, per_sample=objective == "throughput")
    if diff["ci_ms"] is None:
        return True, diff
    return diff["ci_ms"][0] <= 0.0, diff


def recommend(candidates: list[Candidate], objective: str, max_p99_ms: float | None) -> dict[str, Any] | None:
    """Return the recommendation (the chosen candidate with runner_up and margin), or None when none qualifies."""
    apply_constraints(candidates, max_p99_ms)
    eligible = sorted((c for c in candidates if c.meets_constraints), key=_rank_key(objective))
    if not eligible:
        return None
    best = eligible[0]
    rec: dict[str, Any] = {**best.to_dict(), "objective": objective, "eligible": len(eligible)}
    tied = []
    for other in eligible[1:]:
        within, _ = _within_noise(objective, best, other)
        if within:
            tied.append(other.key)
    rec["tied_within_noise"] = tied
    if len(eligible) == 1:
        rec.update(runner_up=None, margin=None, margin_within_noise=None, paired_difference=None)
        rec["verdict"] = "the only candidate meeting every constraint"
        return rec
    runner = eligible[1]
    margin = _margin(objective, best, runner)
    within, diff = _within_noise(objective, best, runner)
    rec.update(
        runner_up=runner.to_dict(),
        margin=round(margin, 4),
        margin_within_noise=within,
        paired_difference=diff,
    )
    measure = {"latency": "p50", "throughput": "throughput", "size": "size"}[objective]
    if within:
        rec["verdict"] = (
            f"{best.key} and the runner-up {runner.key} are within the measured noise on {measure} "
            f"(margin {margin:+.1%}; the paired 95% interval reaches zero): either will do"
        )
    else:
        rec["verdict"] = f"{best.key} beats the runner-up {runner.key} on {measure} by {margin:.1%}, beyond the noise"
    return rec
