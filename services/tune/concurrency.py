"""Throughput under concurrent requests: samples/s at each batch size × instance count, measured in-process.

Triton runs ``instance_group.count`` copies of a model, each serving one request at a time.
This mirrors it: one runner (its own session) per instance and one thread per instance
issuing requests back to back, all released together. A point's throughput is the samples
every instance finished over the round's wall time; rounds visit the points in a shuffled
order, so a change in the machine's load hits them alike, and give each point its spread.

The pick is the measured point of highest median throughput: a point that was not measured
(its batch axis is fixed, the budget ran out) never competes, so an instance count above the
cores is recommended only when it was measured to be fastest.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from services.benchmark import feeds_for_batch
from services.runners import ModelRunner
from services.spec import CompileSpec
from services.steps.host_gate import host_alone
from services.tune.budget import Deadline
from services.tune.measure import open_candidate
from services.tune.report import Candidate
from services.tune.stats import bootstrap_ci

__all__ = ["CONCURRENCY", "CurvePoint", "measure_concurrency", "pick_point"]

#: Concurrent requests (one instance each) the curve is measured at.
CONCURRENCY = (1, 2, 4, 8)
#: Rounds every point gets even when the budget has run out.
MIN_ROUNDS = 2
#: Most requests one instance issues in a round, however short a request is.
MAX_REQUESTS = 1000


@dataclass
class CurvePoint:
    """One batch size × instance count: its median throughput over the rounds, the spread, and request latency."""

    batch: int
    instances: int
    status: str  # measured | skipped (could not run) | failed (an engine error under load)
    throughput: float | None = None  # samples/s, median over the rounds
    throughput_ci: list[float] | None = None  # bootstrap 95% interval of that median
    p50_request_ms: float | None = None  # one request's latency under this load
    rounds: int = 0
    reason: str | None = None
    #: samples/s of each round (kept for the spread; not in the JSON).
    per_round: list[float] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("per_round")
        return d


def _one_round(
    pool: ThreadPoolExecutor, runners: Sequence[ModelRunner], feeds: dict[str, np.ndarray], requests: int
) -> tuple[float, list[float]]:
    """Run ``requests`` back-to-back requests on each runner at once; return the wall seconds and each request's."""
    start = threading.Event()

    def serve(runner: ModelRunner) -> list[float]:
        start.wait()
        took = []
        for _ in range(requests):
            t = time.perf_counter()
            runner.run(feeds)
            took.append(time.perf_counter() - t)
        return took

    futures = [pool.submit(serve, r) for r in runners]
    t0 = time.perf_counter()
    start.set()
    wait(futures)  # all of them, even when one failed: no request of this round outlives it
    wall = time.perf_counter() - t0
    return wall, [s for f in futures for s in f.result()]


def pick_point(points: Sequence[CurvePoint]) -> CurvePoint | None:
    """Return the measured point of highest median throughput (fewer instances, then smaller batch, on a tie)."""
    measured = [p for p in points if p.status == "measured" and p.throughput is not None]
    return max(measured, key=lambda p: (p.throughput or 0.0, -p.instances, -p.batch), default=None)


def measure_concurrency(
    c: Candidate,
    artifact_format: str,
    spec: CompileSpec,
    *,
    batches: Sequence[int],
    deadline: Deadline,
    concurrency: Sequence[int] = CONCURRENCY,
    rounds: int = 5,
    requests: int = 8,
    warmup: int = 2,
    min_round_s: float = 0.05,
) -> dict[str, Any]:
    """Measure ``c``'s throughput at every batch in ``batches`` × instance count in ``concurrency``; pick the best.

    Each instance issues at least ``requests`` requests a round, more for a batch whose single
    request is short, so that one instance's round lasts about ``min_round_s``: a round of a
    few microseconds would measure thread start-up and the scheduler, not the engine. Every
    instance count of one batch issues the same number, so they compare like for like.

    Returns the curve (every point, measured or why not), the pick, the best measured
    throughput and the pick's ratio to it, the points tied with the pick within the noise,
    and how the measurement went.
    """
    levels = sorted(set(concurrency))
    points = {(b, n): CurvePoint(b, n, "skipped") for b in batches for n in levels}
    runners: list[ModelRunner] = []
    rounds_run = 0
    alone: bool | None = None
    per_batch: dict[int, int] = {}
    try:
        try:
            for _ in range(levels[-1]):
                runners.append(open_candidate(c, artifact_format))
        except Exception as exc:  # an engine that cannot open this many sessions must not end the search
            for p in points.values():
                p.reason = f"cannot open {levels[-1]} instances: {exc}"[:300]
            return _result(c, points, levels, per_batch, 0, None)
        feeds: dict[int, dict[str, np.ndarray]] = {}
        for b in batches:
            f = feeds_for_batch(runners[0], spec, b)
            if f is None:
                for n in levels:
                    points[(b, n)].reason = f"its batch axis is fixed: batch {b} cannot run"
                continue
            one = float("inf")
            try:
                for r in runners:
                    for _ in range(warmup):
                        r.run(f)
                for _ in range(3):  # the fastest of three: one slow call must not shorten every round
                    t = time.perf_counter()
                    runners[0].run(f)
                    one = min(one, time.perf_counter() - t)
            except Exception as exc:  # this batch does not run on the engine: its points say why
                for n in levels:
                    points[(b, n)].status, points[(b, n)].reason = "failed", f"batch {b} failed: {exc}"[:300]
                continue
            feeds[b] = f
            per_batch[b] = min(MAX_REQUESTS, max(requests, int(min_round_s / max(one, 1e-9)) + 1))
        todo = [k for k in points if k[0] in feeds]
        latencies: dict[tuple[int, int], list[float]] = {k: [] for k in todo}
        rng = np.random.default_rng(0)
        with host_alone() as quiet, ThreadPoolExecutor(max_workers=levels[-1], thread_name_prefix="kiln-tune") as pool:
            while todo and rounds_run < rounds:
                if rounds_run >= MIN_ROUNDS and deadline.passed():
                    break
                for key in [todo[int(i)] for i in rng.permutation(len(todo))]:
                    b, n = key
                    try:
                        wall, took = _one_round(pool, runners[:n], feeds[b], per_batch[b])
                    except Exception as exc:  # an engine failing under concurrency: that point says so
                        points[key].status, points[key].reason = "failed", f"failed under load: {exc}"[:300]
                        points[key].per_round.clear()
                        todo.remove(key)
                        continue
                    points[key].per_round.append(n * per_batch[b] * b / wall)
                    latencies[key].extend(took)
                rounds_run += 1
            alone = quiet.alone
        for key in todo:
            p = points[key]
            tp = np.asarray(p.per_round)
            p.status, p.rounds = "measured", int(tp.size)
            p.throughput = float(np.median(tp))
            p.throughput_ci = bootstrap_ci(tp)
            p.p50_request_ms = float(np.median(latencies[key]) * 1e3)
            if rounds_run < rounds:
                p.reason = f"budget spent: {rounds_run} of {rounds} rounds run"
    finally:
        for r in runners:
            r.close()
    return _result(c, points, levels, per_batch, rounds_run, alone)


def _result(
    c: Candidate,
    points: dict[tuple[int, int], CurvePoint],
    levels: list[int],
    requests: dict[int, int],
    rounds_run: int,
    alone: bool | None,
) -> dict[str, Any]:
    pick = pick_point(list(points.values()))
    best = max((p.throughput for p in points.values() if p.throughput is not None), default=None)
    tied = []
    if pick is not None and pick.throughput_ci is not None:
        for p in points.values():
            if p is not pick and p.throughput_ci is not None and p.throughput_ci[1] >= pick.throughput_ci[0]:
                tied.append({"batch": p.batch, "instances": p.instances})
    return {
        "candidate": c.key,
        "target": c.target,
        "precision": c.precision,
        "settings": dict(c.settings),
        "concurrency": levels,
        "batches": sorted({b for b, _ in points}),
        "requests_per_instance": {str(b): k for b, k in sorted(requests.items())},  # per round, by batch
        "rounds": rounds_run,
        "cpus": os.cpu_count(),
        "alone": alone,
        "points": [p.to_dict() for p in sorted(points.values(), key=lambda p: (p.batch, p.instances))],
        "pick": pick.to_dict() if pick else None,
        "best_measured_throughput": best,
        "pick_vs_best": (pick.throughput / best) if pick and pick.throughput and best else None,
        "tied_within_noise": tied,
    }
