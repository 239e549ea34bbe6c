"""Compare an artifact's outputs with the source model's on the same inputs."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from services.errors import ParityFailed
from services.spec import Tolerances

__all__ = ["OutputParity", "ParityReport", "check_parity", "compare_outputs", "match_outputs"]


@dataclass
class OutputParity:
    """Agreement of one output over all samples."""

    name: str
    max_abs: float
    max_rel: float
    cosine: float
    top1: float | None  # None when the output is not classifier-shaped
    within_allclose: bool


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


def compare_outputs(name: str, actual: list[np.ndarray], expected: list[np.ndarray], tol: Tolerances) -> OutputParity:
    """Return the agreement of one output across samples (lists of equal-shaped arrays)."""
    a = np.concatenate([np.asarray(x, dtype=np.float64).reshape(-1) for x in actual])
    b = np.concatenate([np.asarray(x, dtype=np.float64).reshape(-1) for x in expected])
    if a.shape != b.shape:
        raise ParityFailed(
            f"output {name}: artifact gives {a.size} values, the source {b.size}",
            output=name,
        )
    diff = np.abs(a - b)
    floor = tol.atol if tol.atol else 1e-6
    max_abs = float(diff.max()) if diff.size else 0.0
    max_rel = float((diff / (np.abs(b) + floor)).max()) if diff.size else 0.0
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 and nb == 0.0:
        cosine = 1.0
    elif na == 0.0 or nb == 0.0:
        cosine = 0.0
    else:
        cosine = float(np.dot(a, b) / (na * nb))
    top1 = None
    if all(_classifier_shaped(np.asarray(x)) for x in expected):
        pa = np.concatenate([np.asarray(x).argmax(axis=1) for x in actual])
        pb = np.concatenate([np.asarray(x).argmax(axis=1) for x in expected])
        top1 = float((pa == pb).mean())
    if tol.atol is None or tol.rtol is None:
        within = True
    else:
        within = bool(np.all(diff <= tol.atol + tol.rtol * np.abs(b)))
    return OutputParity(name, max_abs, max_rel, cosine, top1, within)


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
    a_names = output_order or list(actual[0])
    e_names = expected_order or list(expected[0])
    outputs = []
    for a_name, e_name in match_outputs(a_names, e_names):
        outputs.append(compare_outputs(e_name, [s[a_name] for s in actual], [s[e_name] for s in expected], tol))
    failures = []
    for o in outputs:
        if not o.within_allclose:
            failures.append(
                f"{o.name}: max_abs {o.max_abs:.3g} / max_rel {o.max_rel:.3g} over atol {tol.atol} + rtol {tol.rtol}"
            )
        if tol.min_cosine is not None and o.cosine < tol.min_cosine:
            failures.append(f"{o.name}: cosine {o.cosine:.6f} < {tol.min_cosine}")
        if tol.min_top1 is not None and o.top1 is not None and o.top1 < tol.min_top1:
            failures.append(f"{o.name}: top-1 agreement {o.top1:.1%} < {tol.min_top1:.0%}")
    report = ParityReport(
        outputs=outputs,
        tolerances=tol.model_dump(),
        samples=len(expected),
        inputs_from=inputs_from,
        passed=not failures,
        failures=failures,
    )
    if failures and raise_on_failure:
        raise ParityFailed("parity check failed: " + "; ".join(failures), parity=report.to_dict())
    return report
