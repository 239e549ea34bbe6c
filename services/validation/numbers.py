"""Numbers in verdicts: printed with the digits that make the comparison they report true.

"Pearson 0.9999 < 0.9999" (for 0.99987 against 0.9999) reads as a bug in the gate; the
value is printed with as many digits as it takes to differ from its bound.
"""

from __future__ import annotations

import math

__all__ = ["beside"]


def beside(value: float, bound: float, decimals: int = 4, *, percent: bool = False, most: int = 12) -> tuple[str, str]:
    """Return ``value`` and ``bound`` as text, with at least ``decimals`` decimals and as many more as tell them apart.

    ``percent`` prints both as percentages (``decimals`` counting after the point of the
    percentage). A bound is printed as short as it reads exactly (0.9999, not 0.99990000).
    """
    scale, unit = (100.0, "%") if percent else (1.0, "")
    v, b = value * scale, bound * scale
    if not (math.isfinite(v) and math.isfinite(b)):
        return f"{v}{unit}", f"{b:g}{unit}"
    bound_text = f"{b:.{most}f}".rstrip("0").rstrip(".")
    d = decimals
    while d < most and f"{v:.{d}f}" == f"{b:.{d}f}" and v != b:
        d += 1
    return f"{v:.{d}f}{unit}", f"{bound_text}{unit}"
