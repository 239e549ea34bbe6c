"""The source's own disagreement with itself: what its runtime's two kernel sets give on the same inputs.

Some sources have no single right answer to beat. LiteRT runs a model with its XNNPACK delegate
by default and with its own builtin kernels without it; on an int8 model they round differently
(measured on a full-integer Dense model with outputs of ~128: max |difference| 0.92, SNR 48 dB;
MediaPipe's pose landmarker, logits of ~1700: 2.7). An ONNX source with dynamic quantisation
(``DynamicQuantizeLinear``, ``MatMulInteger``, ...) runs fused integer kernels in onnxruntime at its
default optimisation level and unfused ones without it. The reference step runs such a source both
ways on the parity inputs and records, per output, how far the two are apart (:func:`measure_floor`);
the gate then asks no artifact to agree with the reference more closely than the source's own
kernels agree with each other (:func:`over_floor`): an artifact may differ by twice the floor's
error amplitude (its own rounding on top of the source's disagreement), never by more than int8's
default bounds allow, so a scale, a bias, a constant or a NaN is refused whatever the floor.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from services.formats import Format
from services.spec import DEFAULT_TOLERANCES, Precision, Tolerances

__all__ = ["DYNAMIC_QUANT_OPS", "FLOOR_FACTOR", "alternate_kernels", "measure_floor", "over_floor"]

#: ONNX operators whose result depends on the kernel that quantises activations at run time.
DYNAMIC_QUANT_OPS = frozenset(
    {"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM"}
)
#: An artifact may be this many times further from the reference (in error amplitude) than the source's kernels.
FLOOR_FACTOR = 2.0
#: The floor never loosens a bound past these: what Kiln accepts of any reduced-precision artifact.
_LOOSEST = DEFAULT_TOLERANCES[Precision.INT8]


def alternate_kernels(fmt: Format, path: Path, runner_options: dict[str, Any]) -> tuple[Any, str] | None:
    """Return a runner of the source on its runtime's other kernel set, and what it is; None when it has none.

    TFLite: LiteRT without XNNPACK. ONNX with dynamic quantisation ops: onnxruntime with graph
    optimisation off. Other sources run one way.
    """
    if fmt is Format.TFLITE:
        from services.runners.tflite import TFLiteRunner

        return TFLiteRunner(path, xnnpack=False, **runner_options), "LiteRT's builtin kernels, without XNNPACK"
    if fmt is Format.ONNX:
        import onnx

        header = onnx.load(str(path), load_external_data=False)
        used = sorted({n.op_type for n in header.graph.node} & DYNAMIC_QUANT_OPS)
        if not used:
            return None
        from services.runners.onnx import OnnxRuntimeRunner

        return (
            OnnxRuntimeRunner(path, optimization="disable"),
            f"onnxruntime with graph optimisation off (unfused {', '.join(used)} kernels)",
        )
    return None


def measure_floor(
    primary: list[dict[str, np.ndarray]], alternate: list[dict[str, np.ndarray]], names: list[str]
) -> dict[str, dict[str, float | None]]:
    """Return, per float output, how far the alternate kernels' outputs are from the primary ones."""
    from services.validation.parity import compare_outputs

    out: dict[str, dict[str, float | None]] = {}
    tol = DEFAULT_TOLERANCES[Precision.FP32]
    for name in names:
        ref = [np.asarray(p[name]) for p in primary]
        alt = [np.asarray(a[name]) for a in alternate]
        if not ref or any(r.dtype.kind != "f" for r in ref):
            continue
        o = compare_outputs(name, alt, ref, tol)
        out[name] = {
            "max_abs": o.max_abs,
            "snr_db": o.snr_db,
            "pearson": o.pearson,
            "cosine": o.cosine,
            "scale": o.scale,
            "bias": o.bias,
            "top1": o.top1,
        }
    return out


def _amplitude_of_r(r: float) -> float:
    return math.sqrt(2.0 * max(0.0, 1.0 - r))


def over_floor(tol: Tolerances, floor: dict[str, float | None]) -> tuple[Tolerances, float | None]:
    """Return ``tol`` loosened to what the source's kernels leave, and the absolute error the floor allows.

    Each bound moves only where the floor is worse than it allows, to :data:`FLOOR_FACTOR` times the
    floor's error amplitude, and never past int8's defaults.
    """
    update: dict[str, float] = {}
    k = FLOOR_FACTOR
    snr = floor.get("snr_db")
    if tol.min_snr_db is not None and snr is not None and math.isfinite(snr):
        allowed = snr - 20.0 * math.log10(k)
        update["min_snr_db"] = max(min(tol.min_snr_db, allowed), _LOOSEST.min_snr_db or -100.0)
    for key, metric in (("min_pearson", "pearson"), ("min_cosine", "cosine")):
        bound, value = getattr(tol, key), floor.get(metric)
        if bound is not None and value is not None and math.isfinite(value):
            allowed = 1.0 - (k * _amplitude_of_r(value)) ** 2 / 2.0
            update[key] = max(min(bound, allowed), getattr(_LOOSEST, key) or -1.0)
    for key, metric, ideal in (("max_scale_error", "scale", 1.0), ("max_bias", "bias", 0.0)):
        bound, value = getattr(tol, key), floor.get(metric)
        if bound is not None and value is not None and math.isfinite(value):
            allowed = k * abs(value - ideal)
            update[key] = min(max(bound, allowed), getattr(_LOOSEST, key) or math.inf)
    top1 = floor.get("top1")
    if tol.min_top1 is not None and top1 is not None:
        update["min_top1"] = max(min(tol.min_top1, top1), _LOOSEST.min_top1 or 0.0)
    changed = {key: v for key, v in update.items() if v != getattr(tol, key)}
    max_abs = floor.get("max_abs")
    atol_floor = k * max_abs if max_abs else None
    return tol.model_copy(update=changed), atol_floor
