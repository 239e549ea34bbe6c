"""Compare an artifact's outputs with the source model's on the same inputs."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from services.errors import ParityFailed
from services.spec import Tolerances

__all__ = [
    "OutputParity",
    "ParityReport",
    "check_parity",
    "compare_outputs",
    "match_outputs",
    "verdict_failures",
]


@dataclass
class OutputParity:
    """Agreement of one output over all samples.

    The error metrics cover the values both sides give as finite numbers; ``nonfinite``
    counts the values where the artifact and the source disagree on NaN or infinity (the
    artifact gives one the source does not have, or the other way round). Any such value
    fails parity whatever the tolerances.
    """

    name: str
    max_abs: float
    max_rel: float
    cosine: float
    top1: float | None  # None when the output is not classifier-shaped
    within_allclose: bool
    values: int = 0
    nonfinite: int = 0


@dataclass
class ParityReport:
    """Per-output agreement, the tolerances applied, and the verdict."""

    outputs: list[OutputParity]
    tolerances: dict[str, float | None]
    samples: int
    inputs_from: str
    passed: bool
    failures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return _finite(d)

    def hint(self) -> str | None:
        """Return advice for failures that relaxed tolerances cannot accept, else None (the default hint)."""
        if not self.outputs or sum(o.values for o in self.outputs) == 0:
            return "The model gives no output values to check; export it with its outputs connected."
        if any(o.nonfinite for o in self.outputs):
            return (
                "The artifact gives NaN or infinity where the source gives numbers (fp16 overflow, an int8 "
                "range that rounds to zero, ...); no tolerance accepts that: try a higher precision or "
                "calibration data that covers the model's real inputs."
            )
        return None

    def summary(self) -> str:
        """Return e.g. ``max_abs 3.1e-06 cos 1.000000 top1 100%``."""
        if not self.outputs:
            return "no outputs"
        worst_abs = max(o.max_abs for o in self.outputs)
        worst_cos = min(o.cosine for o in self.outputs)
        top1 = [o.top1 for o in self.outputs if o.top1 is not None]
        text = f"max_abs {worst_abs:.2e} cos {worst_cos:.6f}"
        if top1:
            text += f" top1 {min(top1):.0%}"
        return text


def _finite(obj: Any) -> Any:
    # JSON has no inf/nan; keep reports portable.
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _classifier_shaped(arr: np.ndarray) -> bool:
    return arr.ndim == 2 and arr.shape[1] > 1


def _nonfinite_mismatch(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Return where ``a`` and ``b`` disagree on non-finite values (NaN against NaN agrees)."""
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    both_nan = np.isnan(a) & np.isnan(b)
    same_inf = ~finite_a & ~finite_b & (a == b)
    return (finite_a != finite_b) | (~finite_a & ~finite_b & ~both_nan & ~same_inf)


def compare_outputs(name: str, actual: list[np.ndarray], expected: list[np.ndarray], tol: Tolerances) -> OutputParity:
    """Return the agreement of one output across samples (lists of equal-shaped arrays)."""
    a = np.concatenate([np.asarray(x, dtype=np.float64).reshape(-1) for x in actual])
    b = np.concatenate([np.asarray(x, dtype=np.float64).reshape(-1) for x in expected])
    if a.shape != b.shape:
        raise ParityFailed(
            f"output {name}: artifact gives {a.size} values, the source {b.size}",
            output=name,
        )
    nonfinite = int(_nonfinite_mismatch(a, b).sum())
    # The metrics are taken over values both sides give as finite numbers: a NaN in a metric
    # would pass every `<` comparison, so non-finite disagreement is counted on its own above.
    both = np.isfinite(a) & np.isfinite(b)
    fa, fb = a[both], b[both]
    diff = np.abs(fa - fb)
    floor = tol.atol if tol.atol else 1e-6
    max_abs = float(diff.max()) if diff.size else 0.0
    max_rel = float((diff / (np.abs(fb) + floor)).max()) if diff.size else 0.0
    na, nb = float(np.linalg.norm(fa)), float(np.linalg.norm(fb))
    if na == 0.0 and nb == 0.0:
        cosine = 1.0
    elif na == 0.0 or nb == 0.0 or not (math.isfinite(na) and math.isfinite(nb)):
        cosine = 0.0  # one side all zeros, or too large for float64: no evidence of agreement
    else:
        cosine = float(np.dot(fa, fb) / (na * nb))
    top1 = None
    if all(_classifier_shaped(np.asarray(x)) for x in expected):
        # A row with a non-finite value the source lacks has no trustworthy argmax: it disagrees.
        pa = np.concatenate([_argmax_rows(x, y) for x, y in zip(actual, expected, strict=True)])
        pb = np.concatenate([np.asarray(y).argmax(axis=1) for y in expected])
        top1 = float((pa == pb).mean())
    if tol.atol is None or tol.rtol is None:
        within = True
    else:
        within = bool(np.all(diff <= tol.atol + tol.rtol * np.abs(fb)))
    return OutputParity(name, max_abs, max_rel, cosine, top1, within, values=int(b.size), nonfinite=nonfinite)


def _argmax_rows(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Return each row's argmax of ``actual``, or -1 where the row disagrees on a non-finite value."""
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    bad = _nonfinite_mismatch(a, b).any(axis=1)
    return np.where(bad, -1, a.argmax(axis=1))


def verdict_failures(outputs: list[OutputParity], tol: Tolerances) -> list[str]:
    """Return why ``outputs`` fail ``tol``; empty when they pass.

    Every bound is written as ``not (value >= bound)`` so that a NaN metric fails it, and
    nothing compared (no outputs, or no values) is a failure, never a vacuous pass.
    """
    if not outputs or sum(o.values for o in outputs) == 0:
        return [
            "nothing to compare: the model gives no output values"
            + (f" (outputs {[o.name for o in outputs]} are empty)" if outputs else "")
        ]
    failures = []
    for o in outputs:
        if o.nonfinite:
            failures.append(
                f"{o.name}: {o.nonfinite} of {o.values} values are NaN or infinite where the source's are not"
            )
        if not o.within_allclose:
            failures.append(
                f"{o.name}: max_abs {o.max_abs:.3g} / max_rel {o.max_rel:.3g} over atol {tol.atol} + rtol {tol.rtol}"
            )
        if tol.min_cosine is not None and not (o.cosine >= tol.min_cosine):
            failures.append(f"{o.name}: cosine {o.cosine:.6f} < {tol.min_cosine}")
        if tol.min_top1 is not None and o.top1 is not None and not (o.top1 >= tol.min_top1):
            failures.append(f"{o.name}: top-1 agreement {o.top1:.1%} < {tol.min_top1:.0%}")
    return failures


def match_outputs(actual_names: list[str], expected_names: list[str]) -> list[tuple[str, str]]:
    """Pair artifact outputs with source outputs: by name when the sets agree, else by position.

    Converters often rename outputs (Keras "dense_1" becomes "output_0"), so position is the
    fallback; a differing count is a parity failure, not a guess.
    """
    if set(actual_names) == set(expected_names):
        return [(n, n) for n in expected_names]
    if len(actual_names) != len(expected_names):
        raise ParityFailed(
            f"the artifact has {len(actual_names)} outputs {actual_names}, the source {len(expected_names)} {expected_names}"
        )
    return list(zip(actual_names, expected_names, strict=True))


def check_parity(
    actual: list[dict[str, np.ndarray]],
    expected: list[dict[str, np.ndarray]],
    tol: Tolerances,
    *,
    inputs_from: str,
    output_order: list[str] | None = None,
    expected_order: list[str] | None = None,
    raise_on_failure: bool = True,
) -> ParityReport:
    """Compare per-sample outputs; PARITY_FAILED carries the numbers when a bound is exceeded."""
    if len(actual) != len(expected):
        raise ParityFailed(f"{len(actual)} artifact samples against {len(expected)} reference samples")
    if not expected:
        raise ParityFailed("no samples to compare: the reference step produced none")
    a_names = output_order or list(actual[0])
    e_names = expected_order or list(expected[0])
    outputs = []
    for a_name, e_name in match_outputs(a_names, e_names):
        outputs.append(compare_outputs(e_name, [s[a_name] for s in actual], [s[e_name] for s in expected], tol))
    failures = verdict_failures(outputs, tol)
    report = ParityReport(
        outputs=outputs,
        tolerances=tol.model_dump(),
        samples=len(expected),
        inputs_from=inputs_from,
        passed=not failures,
        failures=failures,
    )
    if failures and raise_on_failure:
        raise ParityFailed("parity check failed: " + "; ".join(failures), hint=report.hint(), parity=report.to_dict())
    return report
