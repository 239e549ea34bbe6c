"""Agreement of one artifact output with the source's, per sample: the numbers the parity gate judges.

Why these and not only cosine: the uncentred cosine of two outputs that share a large
constant part (a bias, a background class, a mean image) is close to 1 whatever the rest
does (measured: an int8 map with Pearson 0.000 against its source had cosine 0.9994), and it
cannot see a scale. So each sample is also judged by centred measures:

- **Pearson correlation**: does the artifact vary where the source varies (a constant map,
  a channel rounded to zero, noise: low);
- **SNR** in dB, ``10 log10(var(reference) / mean((artifact - reference)^2))``: how large the
  error is against the signal's own spread (a scale of x2 gives at most 0 dB, a bias of one
  standard deviation 0 dB, whatever the cosine says);
- **scale**, the least-squares slope of the artifact on the source (1 when the artifact is
  the source plus noise), and **bias**, the mean error in units of the source's standard
  deviation: rounding noise averages out of both, a systematic error does not, so a x1.2
  scale or a shift of a tenth of a deviation shows here even where SNR allows that much noise.

Metrics are taken per sample (a row of the batch axis of each feed) and the gate takes the
worst, so one bad sample among many cannot hide in an average. A sample too small for a
centred measure (fewer than :data:`MIN_CENTRED_VALUES` values, or a constant reference) is
judged against the spread of the whole output instead. Only pairs that both sides give as
finite numbers are compared (``values``); pairs that disagree on NaN or infinity are
counted apart (``nonfinite``) and fail whatever the tolerances.

Top-1 agreement runs along a class axis at any rank: per row of ``[B, C]`` scores, per
position of ``[B, T, V]`` logits, per pixel of ``[N, C, H, W]`` maps (see :func:`class_axis`).
Every row of a ``[B, C]`` classifier counts (but an exact tie of the source): each is a
decision its caller reads. A position of a sequence or a pixel of a map, many of which are
flat (padding, background), counts only where the source's decision is clear: its top two
scores further apart than twice the error the tolerances allow there (the RMS error an artifact at exactly
the SNR bound would have, else ``atol``). A near tie of the source flips under any rounding
an accepted artifact may do, and says nothing about the artifact; the threshold comes from
the source and the bounds, never from the artifact's own error, so a noisy artifact cannot
talk its way out of the count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from services.validation.intervals import DEFAULT_CONFIDENCE, PredictionBound, prediction_bound

__all__ = [
    "MIN_CENTRED_VALUES",
    "OutputMetrics",
    "SampleMetrics",
    "class_axis",
    "elementwise_atol",
    "measure_output",
    "nonfinite_mismatch",
]

#: A sample needs at least this many compared values for its own Pearson and SNR.
MIN_CENTRED_VALUES = 16
#: SNR reported for an exact match (JSON has no infinity, and no bound is this high).
EXACT_SNR_DB = 200.0


@dataclass
class SampleMetrics:
    """One sample's agreement (``index`` counts rows across feeds, in order)."""

    index: int
    values: int
    pearson: float | None
    snr_db: float | None
    cosine: float
    scale: float | None = None
    bias: float | None = None


@dataclass
class OutputMetrics:
    """One output's agreement over every sample: the worst sample's centred measures, and the rest."""

    max_abs: float
    max_rel: float
    cosine: float  # worst sample's
    pearson: float | None  # worst sample's; None: the source's output is constant everywhere
    snr_db: float | None  # worst sample's; None: nothing to measure the error against
    worst_sample: int | None  # the sample that gave the lowest SNR (else Pearson)
    samples: int
    values: int  # pairs both sides give as finite numbers
    nonfinite: int  # pairs that disagree on NaN or infinity
    top1: float | None
    top1_positions: int
    class_axis: int | None
    within_allclose: bool
    scale: float | None  # the sample's slope farthest from 1 (None: no sample varies enough to fit one)
    bias: float | None  # the sample's mean error farthest from 0, in the source's standard deviations
    #: samples whose source varies by fewer units in the last place of its own values than the
    #: SNR bound can resolve (see :func:`_resolvable`): judged by atol/rtol, cosine and top-1 alone
    rounding_level: int = 0
    #: the absolute error allowed on a value near 0: atol scaled by the output's peak (see :func:`elementwise_atol`)
    atol_used: float | None = None
    #: per centred measure, where the next unseen sample falls (services/validation/intervals.py)
    intervals: dict[str, PredictionBound] | None = None


def nonfinite_mismatch(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Return where ``a`` and ``b`` disagree on non-finite values (NaN against NaN agrees)."""
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    both_nan = np.isnan(a) & np.isnan(b)
    same_inf = ~finite_a & ~finite_b & (a == b)
    return (finite_a != finite_b) | (~finite_a & ~finite_b & ~both_nan & ~same_inf)


def class_axis(shape: tuple[int, ...]) -> int | None:
    """Return the axis that holds class scores in an output of ``shape``, or None (no top-1).

    ``[B, C]``: axis 1; ``[B, T, V]`` (sequence logits): the last; ``[N, C, H, W]`` maps: axis 1
    (per pixel). Fewer than two classes on that axis: None. The spec overrides it per output
    (``validation.class_axis``).
    """
    rank = len(shape)
    axis = {2: 1, 3: 2, 4: 1}.get(rank)
    if axis is None or shape[axis] < 2:
        return None
    return axis


def _rows(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Split each feed's output into samples along its batch axis (axis 0 at rank 2 and up, always dropped)."""
    rows: list[np.ndarray] = []
    for arr in arrays:
        x = np.asarray(arr, dtype=np.float64)
        if x.ndim >= 2 and x.shape[0] > 1:
            rows.extend(x[i] for i in range(x.shape[0]))
        else:
            rows.append(x[0] if x.ndim >= 2 else x)
    return rows


def _snr_db(error_power: float, signal: float | None) -> float | None:
    if error_power == 0.0:
        return EXACT_SNR_DB
    if signal is None:
        return None
    if signal == 0.0 or not math.isfinite(error_power):
        return -math.inf
    return min(EXACT_SNR_DB, 10.0 * math.log10(signal / error_power))


def _top1(a_rows: list[np.ndarray], b_rows: list[np.ndarray], axis: int, ties: list[float]) -> tuple[float | None, int]:
    """Return top-1 agreement along ``axis`` of each sample over the positions where the source's decision is clear."""
    agree = counted = 0
    for a_row, b_row, noise in zip(a_rows, b_rows, ties, strict=True):
        a = np.moveaxis(a_row, axis, -1)
        b = np.moveaxis(b_row, axis, -1)
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        if b.shape[-1] < 2:
            continue
        bad = nonfinite_mismatch(a, b).any(axis=1)
        b_clean = np.where(np.isnan(b), -np.inf, b)
        top2 = np.sort(np.partition(b_clean, -2, axis=1)[:, -2:], axis=1)
        with np.errstate(invalid="ignore"):  # inf - inf: a tie of two infinities, not clear
            margin = top2[:, 1] - top2[:, 0]
        clear = (margin > noise) | bad  # a non-finite disagreement always counts (against)
        pa = np.where(bad, -1, np.where(np.isnan(a), -np.inf, a).argmax(axis=1))
        pb = b_clean.argmax(axis=1)
        agree += int(((pa == pb) & clear).sum())
        counted += int(clear.sum())
    return (agree / counted if counted else None), counted


@dataclass
class _Moments:
    """Sums over one sample's compared pairs, centred per sample so pooling them loses nothing."""

    n: int
    mean_a: float
    mean_b: float
    m2a: float  # sum of (a - mean a)^2
    m2b: float
    cab: float  # sum of (a - mean a)(b - mean b)
    err: float  # sum of (a - b)^2
    aa: float  # sums for the (uncentred) cosine
    bb: float
    ab: float

    @classmethod
    def of(cls, a: np.ndarray, b: np.ndarray) -> _Moments:
        if a.size == 0:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        ma, mb = float(a.mean()), float(b.mean())
        da, db = a - ma, b - mb
        d = a - b
        return cls(
            a.size, ma, mb, float(da @ da), float(db @ db), float(da @ db), float(d @ d),
            float(a @ a), float(b @ b), float(a @ b),
        )  # fmt: skip

    @staticmethod
    def pooled(parts: list[_Moments]) -> _Moments | None:
        """Return the moments of all samples together (Chan et al.'s pairwise combination, exact)."""
        parts = [p for p in parts if p.n]
        if not parts:
            return None
        n = sum(p.n for p in parts)
        ma = sum(p.n * p.mean_a for p in parts) / n
        mb = sum(p.n * p.mean_b for p in parts) / n
        return _Moments(
            n,
            ma,
            mb,
            # Products, not ** 2: a float power raises OverflowError where a product gives inf.
            sum(p.m2a + p.n * (p.mean_a - ma) * (p.mean_a - ma) for p in parts),
            sum(p.m2b + p.n * (p.mean_b - mb) * (p.mean_b - mb) for p in parts),
            sum(p.cab + p.n * (p.mean_a - ma) * (p.mean_b - mb) for p in parts),
            sum(p.err for p in parts),
            sum(p.aa for p in parts),
            sum(p.bb for p in parts),
            sum(p.ab for p in parts),
        )

    @property
    def var_b(self) -> float:
        return self.m2b / self.n

    def pearson(self) -> float | None:
        """The correlation; None when the source is constant; 0 when only the artifact is."""
        if self.m2b <= 0.0 or not math.isfinite(self.m2b):
            return None
        if self.m2a <= 0.0 or not math.isfinite(self.m2a):
            return 0.0
        return float(np.clip(self.cab / math.sqrt(self.m2a * self.m2b), -1.0, 1.0))

    def slope(self) -> float | None:
        return self.cab / self.m2b if self.m2b > 0.0 else None

    def cosine(self) -> float:
        if self.aa == 0.0 and self.bb == 0.0:
            return 1.0
        if self.aa == 0.0 or self.bb == 0.0 or not (math.isfinite(self.aa) and math.isfinite(self.bb)):
            return 0.0  # one side all zeros, or too large for float64: no evidence of agreement
        return float(np.clip(self.ab / math.sqrt(self.aa * self.bb), -1.0, 1.0))

    def signal(self) -> float | None:
        """The power the error is measured against: the variance, else the mean square, else None."""
        if self.var_b > 0.0:
            return self.var_b
        ms = self.bb / self.n
        return ms if ms > 0.0 else None


def elementwise_atol(atol: float | None, peak: float) -> float | None:
    """Return the absolute error allowed on an output whose largest source magnitude is ``peak``.

    ``atol`` is written for outputs of unit scale (probabilities, normalised features). On an
    output that reaches 1e3 one unit of atol is far below what its own float type can resolve
    (an fp16 value near 1000 is spaced 0.5 apart, fp32's 6e-5), so an error at rounding level
    failed it: logits of ~1700 refused every fp32 artifact (max_abs 2-5) while the fp16 one
    with the same errors passed fp16's wider atol; an embedding of +-46 refused fp16 at SNR
    48 dB. Scaled by the peak, atol means the same share of the output's range at every
    magnitude; below a peak of 1 it stays as given (never tighter than before), and the
    centred measures, which are scale-free, judge the output's shape either way.
    """
    if atol is None:
        return None
    return atol * max(1.0, peak)


def measure_output(
    actual: list[np.ndarray],
    expected: list[np.ndarray],
    *,
    atol: float | None,
    rtol: float | None,
    min_snr_db: float | None = None,
    axis: int | str | None = "infer",
    confidence: float = DEFAULT_CONFIDENCE,
    atol_floor: float | None = None,
) -> OutputMetrics:
    """Return the agreement of one output, given per feed (lists of equal-shaped arrays).

    ``axis`` is the class axis for top-1 in the feed's layout ("infer": :func:`class_axis`);
    ``atol`` (scaled by the output's peak, :func:`elementwise_atol`) and ``min_snr_db`` also
    set what a tie of the source is (see the module docstring). ``confidence`` is that of each
    measure's prediction bound over the samples (services/validation/intervals.py). Shapes
    must already agree; the caller says what a mismatch means. ``atol_floor``: the absolute
    error the source's own kernels leave (services/validation/noise_floor.py); atol is never below it.
    """
    a_rows, b_rows = _rows(actual), _rows(expected)
    # The centred measures are scale-free: taking them on values divided by the source's
    # largest magnitude keeps squares of outputs near 1e200 (seen in ONNX's own test data) finite.
    unit = _unit(b_rows)
    atol = elementwise_atol(atol, unit)
    if atol is not None and atol_floor:
        atol = max(atol, atol_floor)
    floor = atol if atol else 1e-6
    moments: list[_Moments] = []
    max_abs = max_rel = 0.0
    within = True
    nonfinite = 0
    for ra, rb in zip(a_rows, b_rows, strict=True):
        ra, rb = ra.reshape(-1), rb.reshape(-1)
        ok = np.isfinite(ra) & np.isfinite(rb)
        if not ok.all():
            nonfinite += int(nonfinite_mismatch(ra, rb).sum())
            ra, rb = ra[ok], rb[ok]
        moments.append(_Moments.of(ra / unit, rb / unit))
        if ra.size:
            diff = np.abs(ra - rb)
            max_abs = max(max_abs, float(diff.max()))
            max_rel = max(max_rel, float((diff / (np.abs(rb) + floor)).max()))
            if atol is not None and rtol is not None and within:
                within = bool(np.all(diff <= atol + rtol * np.abs(rb)))
    pooled = _Moments.pooled(moments)
    pooled_signal = pooled.signal() if pooled else None
    dtype = next((np.asarray(e).dtype for e in expected if np.asarray(e).dtype.kind == "f"), None)
    pooled_resolvable = pooled is not None and _resolvable(
        pooled, unit, _rounding_floor(pooled, unit, dtype, min_snr_db)
    )
    floors = [_rounding_floor(m, unit, dtype, min_snr_db) for m in moments]
    per_sample: list[SampleMetrics] = []
    ties: list[float] = []  # per sample: the margin below which the source's top-1 is a tie
    rounding_level = 0
    for i, m in enumerate(moments):
        own = m.n >= MIN_CENTRED_VALUES and m.var_b > 0.0
        signal = m.var_b if own else pooled_signal
        ties.append(_tie_margin(math.sqrt(signal) * unit if signal else None, atol, min_snr_db))
        if m.n == 0:
            continue
        if not (_resolvable(m, unit, floors[i]) if own else pooled_resolvable):
            rounding_level += 1
            per_sample.append(SampleMetrics(i, m.n, None, None, m.cosine()))
            continue
        bias = (m.mean_a - m.mean_b) / math.sqrt(pooled_signal) if pooled_signal and own else None
        per_sample.append(
            SampleMetrics(
                i,
                m.n,
                m.pearson() if own else None,
                _snr_db(m.err / m.n, signal),
                m.cosine(),
                m.slope() if own else None,
                bias,
            )
        )
    # The whole output, pooled, counts too: it judges samples too small to judge alone.
    pearsons = [s.pearson for s in per_sample if s.pearson is not None]
    snrs = [s.snr_db for s in per_sample if s.snr_db is not None]
    scales = [s.scale for s in per_sample if s.scale is not None]
    biases = [s.bias for s in per_sample if s.bias is not None]
    if pooled is not None and pooled_resolvable:
        if pooled.n >= 2 and (r := pooled.pearson()) is not None:
            pearsons.append(r)
        if (snr := _snr_db(pooled.err / pooled.n, pooled_signal)) is not None:
            snrs.append(snr)
        if pooled.n >= 2 and (k := pooled.slope()) is not None:
            scales.append(k)
        if pooled_signal:
            biases.append((pooled.mean_a - pooled.mean_b) / math.sqrt(pooled_signal))
    worst = None
    if per_sample:
        key = [
            (s.snr_db if s.snr_db is not None else math.inf, s.pearson if s.pearson is not None else 2.0)
            for s in per_sample
        ]
        worst = per_sample[int(min(range(len(key)), key=key.__getitem__))].index
    cosines = [s.cosine for s in per_sample]
    resolved = class_axis(np.asarray(expected[0]).shape) if axis == "infer" and expected else axis
    top1, positions = (None, 0)
    if isinstance(resolved, int) and resolved >= 1 and expected:
        if np.ndim(expected[0]) == 2:  # a classifier's rows: each a decision the caller reads, all count
            # ... but one its own float rounding can flip (top two within the resolution floor).
            ties = floors
        top1, positions = _top1(a_rows, b_rows, resolved - 1, ties)  # a row has lost the batch axis
    return OutputMetrics(
        max_abs=max_abs,
        max_rel=max_rel,
        cosine=min(cosines) if cosines else 1.0,
        pearson=min(pearsons) if pearsons else None,
        snr_db=min(snrs) if snrs else None,
        worst_sample=worst,
        samples=len(b_rows),
        values=sum(m.n for m in moments),
        nonfinite=nonfinite,
        top1=top1,
        top1_positions=positions,
        class_axis=resolved if isinstance(resolved, int) else None,
        within_allclose=within,
        scale=max(scales, key=lambda v: abs(v - 1.0)) if scales else None,
        bias=max(biases, key=abs) if biases else None,
        rounding_level=rounding_level,
        atol_used=atol,
        intervals=_intervals(per_sample, confidence),
    )


def _intervals(per_sample: list[SampleMetrics], confidence: float) -> dict[str, PredictionBound]:
    """Return each centred measure's prediction bound over the samples that have it (none below 2)."""
    out = {}
    for metric in ("pearson", "snr_db", "cosine", "scale", "bias"):
        values = [v for s in per_sample if (v := getattr(s, metric)) is not None]
        bound = prediction_bound(metric, values, confidence)
        if bound is not None:
            out[metric] = bound
    return out


def _resolvable(m: _Moments, unit: float, floor: float) -> bool:
    """Whether the source's spread in ``m`` is wide enough, against its values' own float resolution, to judge.

    Meeting an SNR bound of B dB needs an error below 10^(-B/20) of the source's standard
    deviation. When that is less than one unit in the last place (ULP) of the source's own
    values, no artifact computed in that precision can meet it, a correct one included: the
    centred measures would weigh rounding, not the artifact. Measured: EfficientNetB0 with
    random weights gives softmax rows of 1e-3 +- 1.2e-9, about ten float32 ULPs; every
    engine's fp32 artifact (max_abs ~1e-9) then scored SNR 3.5 dB. Such a sample is judged by
    atol/rtol, cosine and top-1 alone, and counted in ``rounding_level``; a classifier row whose
    top two are closer than this floor is a tie of the source, as an exact tie is.
    """
    return math.sqrt(m.var_b) * unit >= floor


def _rounding_floor(m: _Moments, unit: float, dtype: np.dtype | None, min_snr_db: float | None) -> float:
    """The spread below which the SNR bound asks for less than one ULP of the sample's values (0: none)."""
    if min_snr_db is None or dtype is None or m.n == 0:
        return 0.0
    rms = math.sqrt(m.bb / m.n) * unit
    return 10.0 ** (min_snr_db / 20.0) * float(np.spacing(dtype.type(rms)))


def _unit(rows: list[np.ndarray]) -> float:
    """Return the largest finite magnitude of the source's values (1 when there is none)."""
    peak = 0.0
    for r in rows:
        finite = np.abs(r[np.isfinite(r)])
        if finite.size:
            peak = max(peak, float(finite.max()))
    return peak if peak > 0.0 and math.isfinite(peak) else 1.0


def _tie_margin(std: float | None, atol: float | None, min_snr_db: float | None) -> float:
    """Return twice the RMS error the bounds allow on a sample of spread ``std`` (0: only exact ties)."""
    allowed = 0.0
    if min_snr_db is not None and std:
        allowed = std * 10.0 ** (-min_snr_db / 20.0)
    elif atol:
        allowed = atol
    return 2.0 * allowed
