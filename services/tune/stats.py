"""The spread of timings: seeded bootstrap intervals, so a rerun on the same rounds agrees."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["bootstrap_ci"]

_BOOTSTRAP = 1000


def bootstrap_ci(samples: np.ndarray, stat: Any = np.median, level: float = 0.95, seed: int = 0) -> list[float]:
    """Return the bootstrap ``level`` interval of ``stat`` over ``samples`` (seeded, so reruns agree)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(samples), size=(_BOOTSTRAP, len(samples)))
    stats = stat(samples[idx], axis=1)
    lo, hi = np.percentile(stats, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return [float(lo), float(hi)]
