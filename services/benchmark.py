"""Latency and throughput of an artifact on its engine, warm-up excluded."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from services.runners.base import ModelRunner
from services.spec import BenchmarkSpec, CompileSpec
from services.validation.inputs import random_input, refuse_allocation, resolve_shape

__all__ = ["BenchmarkResult", "benchmark_runner", "compare_with_fp32", "feeds_for_batch", "time_interleaved"]


@dataclass
class BenchmarkResult:
    """Timing of one batch size: percentiles in milliseconds, throughput in samples/s."""

    batch_size: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    throughput: float
    iterations: int
    warmup: int
    #: The input shapes timed (open non-batch axes take the spec's opt, else 16: see resolve_shape).
    shapes: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def feeds_for_batch(runner: ModelRunner, spec: CompileSpec, batch: int) -> dict[str, np.ndarray] | None:
    """Return seeded random feeds for ``runner`` at ``batch`` (None when its batch axis is fixed to another size)."""
    shapes = {}
    for t in runner.inputs:
        shape = resolve_shape(t, spec)
        if shape:
            if t.shape and t.shape[0] is not None and t.shape[0] != batch:
                return None  # the batch axis is fixed; this batch size cannot run
            shape[0] = batch
        shapes[t.name] = shape
    refuse_allocation(
        "benchmark.batch_sizes",
        f"a benchmark batch of {batch} ({shapes})",
        {t.name: (shapes[t.name], t.dtype if t.dtype not in ("str", "bfloat16") else "float32") for t in runner.inputs},
        1,
    )
    rng = np.random.default_rng(1234)
    return {t.name: random_input(t, shapes[t.name], rng) for t in runner.inputs}


def benchmark_runner(
    runner: ModelRunner, spec: CompileSpec, settings: BenchmarkSpec | None = None
) -> list[BenchmarkResult]:
    """Time ``runner`` at each batch size in the settings; fixed-batch models run their own size."""
    settings = settings or spec.bench
    results = []
    chosen = bool(settings.batch_sizes)
    sizes = list(settings.batch_sizes) if settings.batch_sizes else spec.benchmark_batch_sizes
    fixed = runner.inputs[0].shape[0] if runner.inputs and runner.inputs[0].shape else None
    if fixed is not None and fixed not in sizes:
        sizes = [fixed]
    for batch in sizes:
        feeds = feeds_for_batch(runner, spec, batch)
        if feeds is None:
            continue
        if not chosen and batch > 1:
            # A default size beyond 1: some exports declare an open batch axis their graph does
            # not honour (a reshape to a fixed batch). Such a model is timed at the sizes it runs.
            try:
                runner.run(feeds)
            except Exception:
                continue
        for _ in range(settings.warmup):
            runner.run(feeds)
        times = np.empty(settings.iterations)
        for i in range(settings.iterations):
            t0 = time.perf_counter()
            runner.run(feeds)
            times[i] = time.perf_counter() - t0
        ms = times * 1e3
        results.append(
            BenchmarkResult(
                batch_size=batch,
                p50_ms=float(np.percentile(ms, 50)),
                p90_ms=float(np.percentile(ms, 90)),
                p99_ms=float(np.percentile(ms, 99)),
                mean_ms=float(ms.mean()),
                throughput=float(batch / times.mean()),
                iterations=settings.iterations,
                warmup=settings.warmup,
                shapes={name: list(arr.shape) for name, arr in feeds.items()},
            )
        )
    return results


def time_interleaved(
    entries: Sequence[tuple[ModelRunner, dict[str, np.ndarray]]],
    warmup: int,
    rounds: int,
    *,
    shuffle_seed: int | None = None,
    keep_going: Callable[[], bool] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> np.ndarray:
    """Return seconds per run, one row per (runner, feeds) entry and one column per round.

    Each round runs every entry once, so drift in the machine's load hits all of them alike.
    With ``shuffle_seed`` the order within each round is shuffled (seeded), so no entry always
    runs right after the same neighbour (whose threads may still be winding down). With
    ``keep_going``, rounds stop early when it returns False; the columns not run are dropped.
    ``clock`` reads the time around each run: wall time unless told (the benchmark scripts
    pass ``time.process_time`` where a run preempted on a shared machine would be overcounted).
    """
    for _ in range(warmup):
        for runner, feeds in entries:
            runner.run(feeds)
    rng = np.random.default_rng(shuffle_seed) if shuffle_seed is not None else None
    times = np.empty((len(entries), rounds))
    order = np.arange(len(entries))
    done = 0
    for i in range(rounds):
        if keep_going is not None and i > 0 and not keep_going():
            break
        if rng is not None:
            rng.shuffle(order)
        for j in order.tolist():
            runner, feeds = entries[j]
            t0 = clock()
            runner.run(feeds)
            times[j, i] = clock() - t0
        done = i + 1
    return times[:, :done]


#: Speed-ups within this band of 1.0 are timing noise on a shared machine, not a difference.
SAME_BAND = 0.05


def compare_with_fp32(
    runner: ModelRunner, fp32: ModelRunner, spec: CompileSpec, precision: str, batch_sizes: list[int]
) -> dict[str, Any]:
    """Time ``runner`` against the same model at fp32 on the same engine, interleaved; say which to deploy.

    Runs alternate (artifact, fp32, artifact, ...) so drift in the machine's load hits both
    alike. ``speedup`` is fp32's p50 over the artifact's: above 1 the artifact is faster.
    """
    settings = spec.bench
    rows = []
    for batch in batch_sizes:
        feeds = feeds_for_batch(runner, spec, batch)
        if feeds is None:
            continue
        base_feeds = dict(zip([t.name for t in fp32.inputs], feeds.values(), strict=False))
        times = time_interleaved([(runner, feeds), (fp32, base_feeds)], settings.warmup, settings.iterations)
        p50, base_p50 = (float(np.percentile(t * 1e3, 50)) for t in times)
        rows.append({"batch_size": batch, "p50_ms": p50, "fp32_p50_ms": base_p50, "speedup": base_p50 / p50})
    speedups = [r["speedup"] for r in rows]
    if not speedups:
        verdict = "unmeasured"
    elif min(speedups) >= 1 + SAME_BAND:
        verdict = "faster"
    elif max(speedups) < 1 - SAME_BAND:
        verdict = "slower"
    else:
        verdict = "same"
    deploy = precision if verdict == "faster" else "fp32"
    reason = {
        "faster": f"{precision} is faster than fp32 at every batch size timed",
        "slower": f"{precision} is slower than fp32 at every batch size timed",
        "same": f"{precision} is not clearly faster than fp32 (within {SAME_BAND:.0%} at some batch size); "
        "fp32 unless its smaller size matters",
        "unmeasured": "no batch size could be timed",
    }[verdict]
    return {"precision": precision, "rows": rows, "verdict": verdict, "deploy": deploy, "reason": reason}
