"""The speed guard: keep the source model when the optimised one runs measurably slower in onnxruntime.

onnxruntime rewrites every graph again when it loads it, and some of its rewrites make
things slower (issue 12: SkipLayerNormalization); a graph that reads better can therefore
run worse. The guard times both models side by side for a fraction of a second and keeps
the faster. It is a floor for the optimise step, not a benchmark: the benchmarks live in
benchmarks/bench_optimizer.py.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx

__all__ = ["MARGIN", "SpeedVerdict", "decide", "time_interleaved", "timing_session"]

#: The optimised model is "measurably slower" when its median per-round time is this much
#: above the source's and it lost every round; single-thread timings on a busy machine
#: move by a few percent between rounds.
MARGIN = 1.05
#: Seconds of timed runs for both models together.
BUDGET_S = 0.5
ROUNDS = 5


@dataclass
class SpeedVerdict:
    """Which model the step keeps and the timings that decided it."""

    kept: str  # "optimised" | "source"
    source_ms: float
    optimised_ms: float
    #: Median over rounds of optimised / source time, with its min and max.
    ratio: float
    ratio_min: float
    ratio_max: float
    rounds: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        for key in ("source_ms", "optimised_ms"):
            body[key] = round(body[key], 4)
        for key in ("ratio", "ratio_min", "ratio_max"):
            body[key] = round(body[key], 3)
        body["engine"] = "onnxruntime"
        return body


def decide(source_s: list[float], optimised_s: list[float], margin: float = MARGIN) -> SpeedVerdict:
    """Return the verdict on per-round times (seconds, the same rounds for both models)."""
    if not source_s or len(source_s) != len(optimised_s):
        raise ValueError("need the same number (> 0) of rounds for both models")
    ratios = [o / s for o, s in zip(optimised_s, source_s, strict=True) if s > 0]
    if not ratios:
        raise ValueError("the source's times are all zero")
    ratio = statistics.median(ratios)
    slower = ratio > margin and min(ratios) > 1.0
    if slower:
        kept = "source"
        reason = (
            f"the optimised model ran {ratio:.2f}x the source's time in onnxruntime "
            f"(slower in all {len(ratios)} rounds): the source model is kept"
        )
    else:
        kept = "optimised"
        reason = f"the optimised model runs in {ratio:.2f}x the source's time in onnxruntime"
    return SpeedVerdict(
        kept=kept,
        source_ms=statistics.median(source_s) * 1e3,
        optimised_ms=statistics.median(optimised_s) * 1e3,
        ratio=ratio,
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        rounds=len(ratios),
        reason=reason,
    )


def timing_session(model: onnx.ModelProto) -> Any:
    """Return an onnxruntime CPU session as a server runs the model (all its rewrites on), one thread."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # One thread: onnxruntime then runs on the calling thread, whose CPU time is the clock,
    # so waiting for a core that other jobs hold is not counted.
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def time_interleaved(
    source: Any,
    optimised: Any,
    feed: dict[str, np.ndarray],
    *,
    budget_s: float = BUDGET_S,
    rounds: int = ROUNDS,
    clock: Callable[[], float] = time.thread_time,
) -> tuple[list[float], list[float]] | None:
    """Return per-round median run times (seconds) of two sessions, alternating which goes first.

    None when one run does not fit in a round's share of ``budget_s``: such a model is
    too slow to time within the step's budget, and the guard says so instead.
    """
    share = budget_s / (2 * rounds)
    for session in (source, optimised):
        session.run(None, feed)  # warm-up: the first run allocates and pre-packs
        t0 = clock()
        session.run(None, feed)
        if clock() - t0 > share:
            return None
    times: tuple[list[float], list[float]] = ([], [])
    pair = (source, optimised)
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for i in order:
            runs: list[float] = []
            started = clock()
            while not runs or clock() - started < share:
                t0 = clock()
                pair[i].run(None, feed)
                runs.append(clock() - t0)
            times[i].append(statistics.median(runs))
    return times
