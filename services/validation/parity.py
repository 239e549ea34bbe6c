"""Compare an artifact's outputs with the source model's on the same inputs."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from services.errors import ParityFailed
from services.spec import Tolerances
from services.validation.intervals import DEFAULT_CONFIDENCE
from services.validation.metrics import measure_output
from services.validation.numbers import beside

__all__ = [
    "OutputParity",
    "ParityReport",
    "check_parity",
    "compare_outputs",
    "match_outputs",
    "shown",
    "verdict_failures",
]


@dataclass
class OutputParity:
    """Agreement of one output over all samples (services/validation/metrics.py says how each is taken).

    ``cosine``, ``pearson`` and ``snr_db`` are the worst sample's (``worst_sample``), never an
    average; ``values`` counts the pairs both sides give as finite numbers, the only ones the
    metrics cover; ``nonfinite`` counts the pairs that disagree on NaN or infinity (the
    artifact gives one the source does not have, or the other way round), which fail parity
    whatever the tolerances. ``top1`` runs along ``class_axis`` over ``top1_positions``
    positions where the source's decision is clear.
    """

    name: str
    max_abs: float
    max_rel: float
    cosine: float
    top1: float | None  # None when the output has no class axis (or no clear position)
    within_allclose: bool
    values: int = 0
    nonfinite: int = 0
    pearson: float | None = None  # None when the source's output is constant everywhere
    snr_db: float | None = None
    worst_sample: int | None = None
    samples: int = 0
    class_axis: int | None = None
    top1_positions: int = 0
    scale: float | None = None  # least-squares slope of the artifact on the source, the worst sample's
    bias: float | None = None  # mean error in the source's standard deviations, the worst sample's
    #: samples whose source varies within its own float rounding (metrics.py's _resolvable): no centred measure
    rounding_level: int = 0
    #: the elementwise absolute bound applied: atol scaled by the output's peak (metrics.py's elementwise_atol)
    atol_used: float | None = None
    #: per centred measure: where the next unseen sample falls (services/validation/intervals.py); the gate
    #: decides on ``pessimistic``
    intervals: dict[str, dict[str, float | int]] = field(default_factory=dict)
    #: the source's own kernels against each other on this output, and the bounds that floor loosened
    #: (services/validation/noise_floor.py); None: the source runs one way
    noise_floor: dict[str, Any] | None = None


@dataclass
class ParityReport:
    """Per-output agreement, the tolerances applied, and the verdict."""

    outputs: list[OutputParity]
    tolerances: dict[str, float | None]
    samples: int
    inputs_from: str
    passed: bool
    failures: list[str] = field(default_factory=list)
    input_provenance: dict[str, str] = field(default_factory=dict)  # how each input's values were made
    shapes: list[dict[str, list[int]]] = field(default_factory=list)  # the input shapes checked
    samples_per_shape: list[int] = field(default_factory=list)  # feeds checked at each of ``shapes``
    localization: dict[str, Any] | None = None  # the first node that drifts (services/validation/localize.py)
    reference_from: str | None = None  # the runtime that ran the source for the reference
    #: what the verdict rests on: unseen samples (real, synthesized), how many are required, the interval used
    evidence: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return _finite(d)

    def hint(self, precision: str | None = None) -> str | None:
        """Return advice that fits the failure and the artifact's ``precision``; None: the error's default hint.

        A reduced-precision artifact may be rescued by a higher precision or better calibration;
        an fp32 one cannot: its conversion changed what the model computes.
        """
        reduced = precision not in (None, "fp32")
        if not self.outputs or sum(o.values + o.nonfinite for o in self.outputs) == 0:
            return "The model gives no output values to check; export it with its outputs connected."
        if any(o.nonfinite for o in self.outputs):
            if not reduced and precision is not None:
                return (
                    "The fp32 artifact gives NaN or infinity where the source gives numbers: its conversion "
                    "changed the model (no tolerance accepts that). The first divergent node is in "
                    "details.parity.localization; another route or engine may convert it faithfully."
                )
            return (
                "The artifact gives NaN or infinity where the source gives numbers (fp16 overflow, an int8 "
                "range that rounds to zero, ...); no tolerance accepts that: try a higher precision or "
                "calibration data that covers the model's real inputs."
            )
        if any(o.values == 0 for o in self.outputs):
            return "An output has no value both sides give as a number; check that the inputs are valid for the model."
        if precision == "fp32":
            return (
                "The fp32 artifact computes something other than the source: its conversion changed the model "
                "(the first divergent node is in details.parity.localization, or set validation.localize). "
                "Try another route or engine; relax `tolerances` only if you know the difference is benign."
            )
        if reduced:
            return (
                f"The {precision} artifact's outputs differ from the source beyond tolerance: try a higher "
                "precision, calibration data that covers the model's real inputs (int8), or relax `tolerances` "
                "if the difference is acceptable."
            )
        return None

    def summary(self) -> str:
        """Return e.g. ``max_abs 3.1e-06 cos 1.000000 top1 100%``."""
        if not self.outputs:
            return "no outputs"
        worst_abs = max(o.max_abs for o in self.outputs)
        worst_cos = min(o.cosine for o in self.outputs)
        top1 = [o.top1 for o in self.outputs if o.top1 is not None]
        snr = [o.snr_db for o in self.outputs if o.snr_db is not None]
        pearson = [o.pearson for o in self.outputs if o.pearson is not None]
        text = f"max_abs {worst_abs:.2e} cos {worst_cos:.6f}"
        if pearson:
            text += f" r {min(pearson):.4f}"
        if snr:
            text += f" snr {min(snr):.1f}dB"
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


def compare_outputs(
    name: str,
    actual: list[np.ndarray],
    expected: list[np.ndarray],
    tol: Tolerances,
    *,
    class_axis: int | str | None = "infer",
    confidence: float = DEFAULT_CONFIDENCE,
    atol_floor: float | None = None,
) -> OutputParity:
    """Return the agreement of one output across samples (lists of equal-shaped arrays, one per feed)."""
    for i, (x, y) in enumerate(zip(actual, expected, strict=True)):
        if np.shape(x) != np.shape(y) and np.size(x) != np.size(y):
            raise ParityFailed(
                f"output {name}: on sample {i} the artifact gives shape {list(np.shape(x))}, "
                f"the source {list(np.shape(y))}",
                output=name,
            )
    # A converter may keep the values and drop a unit axis: compare in the source's layout.
    actual = [np.reshape(x, np.shape(y)) for x, y in zip(actual, expected, strict=True)]
    if any(np.asarray(y).dtype.kind in "USO" for y in expected):
        return _compare_exactly(name, actual, expected)
    m = measure_output(
        actual,
        expected,
        atol=tol.atol,
        rtol=tol.rtol,
        min_snr_db=tol.min_snr_db,
        axis=class_axis,
        confidence=confidence,
        atol_floor=atol_floor,
    )
    return OutputParity(
        name,
        m.max_abs,
        m.max_rel,
        m.cosine,
        m.top1,
        m.within_allclose,
        values=m.values,
        nonfinite=m.nonfinite,
        pearson=m.pearson,
        snr_db=m.snr_db,
        worst_sample=m.worst_sample,
        samples=m.samples,
        class_axis=m.class_axis,
        top1_positions=m.top1_positions,
        scale=m.scale,
        bias=m.bias,
        rounding_level=m.rounding_level,
        atol_used=m.atol_used,
        intervals={k: v.to_dict() for k, v in (m.intervals or {}).items()},
    )


def _compare_exactly(name: str, actual: list[np.ndarray], expected: list[np.ndarray]) -> OutputParity:
    """Return the agreement of a string output: every value equal, or no agreement at all."""
    values = sum(int(np.size(y)) for y in expected)
    equal = all(
        np.array_equal(np.asarray(x).astype(str), np.asarray(y).astype(str))
        for x, y in zip(actual, expected, strict=True)
    )
    return OutputParity(
        name, 0.0 if equal else math.inf, 0.0 if equal else math.inf, 1.0 if equal else 0.0, None, equal,
        values=values, samples=len(expected),
    )  # fmt: skip


def shown(value: float, bound: float, fails: str) -> str:
    """Return ``value`` with the fewest significant digits (4 at least) that keep it on its side of ``bound``.

    ``fails`` is the comparison the message states: ``"<"`` (value below bound) or ``">"``.
    A Pearson of 0.99987 against 0.9999 prints as 0.99987, never as "0.9999 < 0.9999".
    """
    if not math.isfinite(value):
        return str(value)
    for digits in range(4, 18):
        text = f"{value:.{digits}g}"
        if (float(text) < bound) if fails == "<" else (float(text) > bound):
            return text
    return repr(value)


def _decided(metric: str, value: float, tol: Tolerances) -> bool:
    """Return whether ``value`` of ``metric`` meets its bound in ``tol`` (True when unbounded); NaN fails."""
    bound = {
        "pearson": tol.min_pearson,
        "cosine": tol.min_cosine,
        "snr_db": tol.min_snr_db,
        "scale": tol.max_scale_error,
        "bias": tol.max_bias,
    }[metric]
    if bound is None:
        return True
    if metric == "scale":
        return abs(value - 1.0) <= bound
    if metric == "bias":
        return abs(value) <= bound
    return value >= bound


_LABEL = {"pearson": "Pearson", "cosine": "cosine", "snr_db": "SNR", "scale": "scale", "bias": "bias"}


def _interval_failure(o: OutputParity, metric: str, tol: Tolerances) -> str | None:
    """Return why the pessimistic end of ``metric``'s prediction bound fails ``tol``, else None."""
    iv = o.intervals.get(metric)
    if not iv or _decided(metric, float(iv["pessimistic"]), tol):
        return None
    pess = float(iv["pessimistic"])
    level = f"{float(iv['confidence']):.0%}"
    n = int(iv["n"])
    if metric == "scale":
        assert tol.max_scale_error is not None
        shown_value = shown(abs(pess - 1.0), tol.max_scale_error, ">")
        said = f"|scale - 1| {shown_value} > {tol.max_scale_error}"
    elif metric == "bias":
        assert tol.max_bias is not None
        said = f"|bias| {shown(abs(pess), tol.max_bias, '>')} > {tol.max_bias} standard deviations"
    else:
        bound = {"pearson": tol.min_pearson, "cosine": tol.min_cosine, "snr_db": tol.min_snr_db}[metric]
        assert bound is not None
        unit = " dB" if metric == "snr_db" else ""
        said = f"{_LABEL[metric]} {shown(pess, bound, '<')}{unit} < {bound}{unit}"
    return (
        f"{o.name}: on the next unseen input {said} ({level} prediction bound over {n} samples; "
        f"interval [{iv['low']:.4g}, {iv['high']:.4g}])"
    )


def verdict_failures(
    outputs: list[OutputParity],
    tol: Tolerances,
    evidence: dict[str, Any] | None = None,
    per_output: dict[str, Tolerances] | None = None,
) -> list[str]:
    """Return why ``outputs`` fail ``tol``; empty when they pass.

    Every bound is written as ``not (value >= bound)`` so that a NaN metric fails it, and
    nothing compared (no outputs, or no values) is a failure, never a vacuous pass. Each
    centred measure is judged on its worst sample and, where it has one, on the pessimistic end
    of its prediction bound over the samples (services/validation/intervals.py). ``evidence``
    (from the reference step) fails a check resting on fewer unseen samples than it requires;
    ``per_output`` gives an output its own bounds (those its source's noise floor loosened).
    """
    if not outputs or sum(o.values + o.nonfinite for o in outputs) == 0:
        return [
            "nothing to compare: the model gives no output values"
            + (f" (outputs {[o.name for o in outputs]} are empty)" if outputs else "")
        ]
    failures = []
    base = tol
    if evidence and evidence.get("required") and int(evidence.get("unseen", 0)) < int(evidence["required"]):
        failures.append(
            f"parity rests on {evidence.get('unseen', 0)} samples the quantiser never saw, fewer than the "
            f"{evidence['required']} required (validation.min_unseen_samples)"
        )
    for o in outputs:
        tol = (per_output or {}).get(o.name, base)
        where = f" (worst sample {o.worst_sample})" if o.worst_sample is not None and o.samples > 1 else ""
        if o.nonfinite:
            failures.append(
                f"{o.name}: {o.nonfinite} values are NaN or infinite on one side only ({o.values} compared)"
            )
        if o.values == 0 and not o.nonfinite:
            failures.append(f"{o.name}: nothing compared (no value is finite on both sides)")
        if not o.within_allclose:
            atol = o.atol_used if o.atol_used is not None else tol.atol
            scaled = f" (atol {tol.atol} x the output's peak)" if atol != tol.atol else ""
            shown_atol = f"{atol:.3g}" if atol is not None else "None"
            failures.append(
                f"{o.name}: max_abs {o.max_abs:.3g} / max_rel {o.max_rel:.3g} over atol {shown_atol}{scaled} "
                f"+ rtol {tol.rtol}"
            )
        if tol.min_cosine is not None and not (o.cosine >= tol.min_cosine):
            failures.append("{}: cosine {} < {}{}".format(o.name, *beside(o.cosine, tol.min_cosine, 6), where))
        if tol.min_pearson is not None and o.pearson is not None and not (o.pearson >= tol.min_pearson):
            failures.append("{}: Pearson {} < {}{}".format(o.name, *beside(o.pearson, tol.min_pearson), where))
        if tol.min_snr_db is not None and o.snr_db is not None and not (o.snr_db >= tol.min_snr_db):
            failures.append("{}: SNR {} dB < {} dB{}".format(o.name, *beside(o.snr_db, tol.min_snr_db, 1), where))
        if tol.max_scale_error is not None and o.scale is not None and not (abs(o.scale - 1.0) <= tol.max_scale_error):
            failures.append(
                f"{o.name}: scale {o.scale:.4f} (the artifact's slope on the source) is off 1 by "
                f"{shown(abs(o.scale - 1.0), tol.max_scale_error, '>')}, more than {tol.max_scale_error}{where}"
            )
        if tol.max_bias is not None and o.bias is not None and not (abs(o.bias) <= tol.max_bias):
            failures.append(
                f"{o.name}: bias {o.bias:+.4g} standard deviations, |bias| "
                f"{shown(abs(o.bias), tol.max_bias, '>')} beyond {tol.max_bias}{where}"
            )
        # Named for every measure whose interval fails, the worst sample's failure or not: the verdict
        # rests on both, and the interval says how far the next input may go.
        for metric in ("pearson", "snr_db", "cosine", "scale", "bias"):
            if why := _interval_failure(o, metric, tol):
                failures.append(why)
        if tol.min_top1 is not None and o.top1 is not None and not (o.top1 >= tol.min_top1):
            failures.append(
                "{}: top-1 agreement {} < {}".format(o.name, *beside(o.top1, tol.min_top1, 1, percent=True))
            )
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
    class_axes: dict[str, int | None] | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
    evidence: dict[str, Any] | None = None,
    noise_floor: dict[str, Any] | None = None,
) -> ParityReport:
    """Compare per-sample outputs; PARITY_FAILED carries the numbers when a bound is exceeded.

    ``class_axes`` sets the top-1 axis of outputs by source name (None: no top-1); the others are
    inferred. ``confidence`` is that of each measure's prediction bound; ``evidence`` says what
    the samples are and how many unseen ones the verdict needs (see :func:`verdict_failures`);
    ``noise_floor`` (``{"kernels": ..., "outputs": {name: floor}}``, from the reference step) loosens
    an output's bounds to what its source's own kernels leave (services/validation/noise_floor.py).
    """
    if len(actual) != len(expected):
        raise ParityFailed(f"{len(actual)} artifact samples against {len(expected)} reference samples")
    if not expected:
        raise ParityFailed("no samples to compare: the reference step produced none")
    a_names = output_order or list(actual[0])
    e_names = expected_order or list(expected[0])
    outputs = []
    per_output: dict[str, Tolerances] = {}
    floors = (noise_floor or {}).get("outputs") or {}
    for a_name, e_name in match_outputs(a_names, e_names):
        axis: int | str | None = (class_axes or {}).get(e_name, "infer")
        own, atol_floor = tol, None
        if e_name in floors:
            from services.validation.noise_floor import over_floor

            own, atol_floor = over_floor(tol, floors[e_name])
            per_output[e_name] = own
        out = compare_outputs(
            e_name,
            [s[a_name] for s in actual],
            [s[e_name] for s in expected],
            own,
            class_axis=axis,
            confidence=confidence,
            atol_floor=atol_floor,
        )
        if e_name in floors:
            loosened = {k: v for k, v in own.model_dump().items() if v != getattr(tol, k)}
            out.noise_floor = {
                "kernels": (noise_floor or {}).get("kernels"),
                "measured": floors[e_name],
                "bounds": loosened,
                "atol_floor": atol_floor,
            }
        outputs.append(out)
    failures = verdict_failures(outputs, tol, evidence, per_output)
    report = ParityReport(
        outputs=outputs,
        tolerances=tol.model_dump(),
        samples=len(expected),
        inputs_from=inputs_from,
        passed=not failures,
        failures=failures,
        evidence=evidence,
    )
    if failures and raise_on_failure:
        raise ParityFailed("parity check failed: " + "; ".join(failures), hint=report.hint(), parity=report.to_dict())
    return report
