"""How far the next unseen input may fall: a prediction interval for each per-sample parity measure.

The gate judges every output on its worst sample. With few samples the worst of them says
little about the next input a user feeds: an int8 text encoder judged on 2 held-out rows
scored Pearson 0.947 there, and 0.80 and 0.89 on 2 of 12 other real sentences. So each
decisive measure is also given an interval over its samples, and the gate decides on its
pessimistic end.

Which interval, and why:

- **A prediction interval, not the mean's confidence interval.** The claim a verified
  artifact makes is about each input, not about an average: the mean's interval shrinks onto
  the mean as samples grow and would pass an artifact whose mean clears the bound while one
  input in six does not (that encoder: mean 0.944, bound 0.94). The one-sided prediction
  bound ``m + t(n-1) * s * sqrt(1 + 1/n)`` is where the next sample falls with the stated
  confidence (95% by default) under a normal model: it widens as samples get fewer (2
  samples: 7.7 standard deviations; 8: 2.0; 64: 1.7), so evidence has to grow with the claim.
- **Analytic, not a bootstrap.** A bootstrap resamples the samples it has: with 2 of them its
  interval is their range, so it would claim from 2 samples what it claims from 200. The
  Student t factor carries the uncertainty of the spread itself.
- **On the error's amplitude.** Each measure is read as the relative RMS error it implies, the
  scale on which sound artifacts vary symmetrically and an exact match is 0:
  ``10^(-SNR/20)`` for SNR, ``sqrt(2 (1 - r))`` for Pearson and cosine (the same quantity when
  the error is noise), ``scale - 1`` and the bias as they are. On their own scales an exact
  fp32 sample (SNR 200 dB) beside an 85 dB one would make a spread of 80 dB and a bound far
  below both; on the amplitude both are ~0.

Top-1 agreement is a count, not a per-sample measure: it is decided on what was observed (an
fp32 bound of 100% cannot be met by any interval's lower end) and ties are handled by the
margin rule in metrics.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

__all__ = ["DEFAULT_CONFIDENCE", "PredictionBound", "prediction_bound", "student_t_quantile"]

#: One-sided confidence of the prediction bound the gate decides on.
DEFAULT_CONFIDENCE = 0.95


def _t_two_sided(t: float, dof: int) -> float:
    """Return P(|T| < t) for Student's t with an integer ``dof`` (Abramowitz and Stegun 26.7.3-4: exact series)."""
    theta = math.atan(t / math.sqrt(dof))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if dof % 2:  # odd
        term, total = 1.0, 1.0
        for k in range(2, dof - 1, 2):
            term *= c2 * k / (k + 1)
            total += term
        return (2.0 / math.pi) * (theta + (s * math.cos(theta) * total if dof > 1 else 0.0))
    term, total = 1.0, 1.0
    for k in range(1, dof - 2, 2):
        term *= c2 * k / (k + 1)
        total += term
    return s * total


def student_t_quantile(p: float, dof: int) -> float:
    """Return Student's t quantile at ``p`` with ``dof`` degrees of freedom.

    Found by bisection on the exact distribution function for integer degrees of freedom
    (scipy is not a dependency of Kiln's core; tests/test_parity_evidence.py checks it against
    scipy); from 1000 on, the normal quantile, which it then matches to 0.1%.
    """
    if not 0.5 <= p < 1.0 or dof < 1:
        raise ValueError(f"need 0.5 <= p < 1 and dof >= 1, got p={p}, dof={dof}")
    if dof >= 1000:
        return NormalDist().inv_cdf(p)
    target = 2.0 * p - 1.0
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, dof) < target:
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        if _t_two_sided(mid, dof) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


@dataclass
class PredictionBound:
    """One measure's interval over ``n`` samples: where the next sample falls, on the measure's own scale.

    ``low``/``high`` bound the next sample's value; ``pessimistic`` is the end the gate decides
    on (the lower for Pearson, cosine and SNR; the farther from 1 or 0 for scale and bias).
    """

    n: int
    low: float
    high: float
    pessimistic: float
    confidence: float

    def to_dict(self) -> dict[str, float | int]:
        return {
            "n": self.n,
            "low": self.low,
            "high": self.high,
            "pessimistic": self.pessimistic,
            "confidence": self.confidence,
        }


def _amplitude(metric: str, value: float) -> float:
    if metric == "snr_db":
        return 10.0 ** (-value / 20.0)
    if metric in ("pearson", "cosine"):
        return math.sqrt(2.0 * max(0.0, 1.0 - value))
    if metric == "scale":
        return value - 1.0
    return value  # bias: already an error in standard deviations


def _measure(metric: str, amplitude: float) -> float:
    if metric == "snr_db":
        return 200.0 if amplitude <= 0.0 else -20.0 * math.log10(amplitude)
    if metric in ("pearson", "cosine"):
        return max(-1.0, 1.0 - amplitude * amplitude / 2.0)
    if metric == "scale":
        return 1.0 + amplitude
    return amplitude


def prediction_bound(
    metric: str, values: list[float], confidence: float = DEFAULT_CONFIDENCE
) -> PredictionBound | None:
    """Return the one-sided prediction bound of ``metric`` (pearson, cosine, snr_db, scale, bias) over ``values``.

    None with fewer than 2 finite values: one sample has no spread to predict from.
    """
    amps = [_amplitude(metric, v) for v in values if v is not None and math.isfinite(v)]
    n = len(amps)
    if n < 2:
        return None
    mean = sum(amps) / n
    sd = math.sqrt(sum((a - mean) ** 2 for a in amps) / (n - 1))
    half = student_t_quantile(confidence, n - 1) * sd * math.sqrt(1.0 + 1.0 / n)
    signed = metric in ("scale", "bias")
    if signed:
        lo_a, hi_a = mean - half, mean + half
        worst = hi_a if abs(hi_a) >= abs(lo_a) else lo_a
        low, high = _measure(metric, lo_a), _measure(metric, hi_a)
        return PredictionBound(n, low, high, _measure(metric, worst), confidence)
    # An amplitude cannot go below 0: the optimistic end is the exact match.
    upper = mean + half
    pessimistic = _measure(metric, upper)
    best = _measure(metric, max(0.0, mean - half))
    return PredictionBound(n, pessimistic, best, pessimistic, confidence)
