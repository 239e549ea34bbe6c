"""The safety net: run a model and its optimised version in onnxruntime on the same feeds.

Constant folding and weight fusion reassociate floating-point arithmetic, so outputs may
move by round-off; anything beyond that is a changed model. Floats are compared relative
to each output's magnitude, integers, booleans and strings exactly.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import EncodeError

from services.onnx_io import save_onnx
from services.tensors import TensorSpec

__all__ = ["FLOAT_RTOL", "OutputCheck", "compare_arrays", "ort_session", "session_inputs"]

#: Allowed difference relative to max(|expected|) + |expected|, per float dtype.
FLOAT_RTOL: dict[str, float] = {"float64": 1e-7, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def ort_session(model: onnx.ModelProto, *, optimize: bool = False) -> Any:
    """Return an onnxruntime CPU session for an in-memory model (ORT's own rewrites off by default)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not optimize:
        # Compare the graphs as written: ORT's own fusions would blur which side changed what.
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # Serialising is the size check: protobuf's ByteSize encodes the whole message too, which
    # costs as much (0.6 s for 512 MiB of weights); a model past protobuf's 2 GiB limit goes
    # through a file with external data instead.
    try:
        data = model.SerializeToString()
    except (ValueError, EncodeError):  # over 2 GiB
        data = None
    if data is not None:
        return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        path = Path(tmp) / "model.onnx"
        save_onnx(model, path)
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def session_inputs(session: Any) -> list[TensorSpec]:
    """Return a session's inputs as TensorSpecs (None for dynamic axes)."""
    from services.runners.onnx import ORT_DTYPES

    return [
        TensorSpec(
            a.name, ORT_DTYPES.get(a.type, a.type), tuple(d if isinstance(d, int) and d >= 0 else None for d in a.shape)
        )
        for a in session.get_inputs()
    ]


def compare_arrays(actual: Any, expected: Any) -> str | None:
    """Return why ``actual`` differs from ``expected`` beyond round-off, or None when it does not."""
    if isinstance(expected, (list, dict)):  # sequence / map outputs
        if type(actual) is not type(expected) or len(actual) != len(expected):
            return "sequence or map output differs in kind or length"
        keys = range(len(expected)) if isinstance(expected, list) else expected.keys()
        for k in keys:
            if k not in (actual if isinstance(actual, dict) else range(len(actual))):
                return f"map key {k!r} missing"
            problem = compare_arrays(actual[k], expected[k])
            if problem is not None:
                return f"item {k!r}: {problem}"
        return None
    a, e = np.asarray(actual), np.asarray(expected)
    if a.shape != e.shape:
        return f"shape {list(a.shape)} != {list(e.shape)}"
    if a.dtype != e.dtype:
        return f"dtype {a.dtype} != {e.dtype}"
    rtol = FLOAT_RTOL.get(str(e.dtype))
    if rtol is None:
        if e.dtype == object:
            same = a.tolist() == e.tolist()
        else:
            same = bool(np.array_equal(a, e))
        return None if same else f"{int(np.sum(a != e))} of {e.size} values differ (exact compare)"
    a64, e64 = a.astype(np.float64), e.astype(np.float64)
    if not np.array_equal(np.isnan(a64), np.isnan(e64)):
        return "NaN positions differ"
    finite = np.isfinite(e64)
    if not np.array_equal(a64[~finite & ~np.isnan(e64)], e64[~finite & ~np.isnan(e64)]):
        return "infinities differ"
    if not finite.any():
        return None
    scale = float(np.max(np.abs(e64[finite])))
    diff = np.abs(a64[finite] - e64[finite])
    bound = rtol * (np.abs(e64[finite]) + scale)
    if np.all(diff <= bound):
        return None
    return f"max |diff| {float(np.max(diff)):.3g} beyond {rtol:g} x (|expected| + {scale:.3g})"


@dataclass
class OutputCheck:
    """Feeds plus the original model's outputs for them; ``compare`` checks a candidate model."""

    feeds: list[dict[str, np.ndarray]]
    expected: list[list[np.ndarray]]
    output_names: list[str]

    @classmethod
    def for_model(
        cls, model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], *, session: Any = None
    ) -> OutputCheck:
        """Run ``model`` (or ``session``, already made from it) on ``feeds``; raises whatever onnxruntime raises."""
        session = session if session is not None else ort_session(model)
        names = [o.name for o in session.get_outputs()]
        return cls(feeds, [session.run(names, feed) for feed in feeds], names)

    @property
    def samples(self) -> int:
        return len(self.feeds)

    def compare(self, candidate: onnx.ModelProto) -> str | None:
        """Return why ``candidate`` disagrees with the original on the feeds, or None when it agrees."""
        try:
            session = ort_session(candidate)
            names = [o.name for o in session.get_outputs()]
            if names != self.output_names:
                return f"outputs {names} != {self.output_names}"
            actual = [session.run(names, feed) for feed in self.feeds]
        except Exception as exc:
            return f"onnxruntime cannot run the optimised model: {type(exc).__name__}: {str(exc)[:300]}"
        for i, (got, want) in enumerate(zip(actual, self.expected, strict=True)):
            for name, g, w in zip(names, got, want, strict=True):
                problem = compare_arrays(g, w)
                if problem is not None:
                    return f"sample {i}, output {name!r}: {problem}"
        return None
