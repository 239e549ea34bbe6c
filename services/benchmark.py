"""Latency and throughput of an artifact on its engine, warm-up excluded."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from services.runners.base import ModelRunner
from services.spec import BenchmarkSpec, CompileSpec
from services.validation.inputs import random_input, refuse_allocation, resolve_shape

__all__ = ["BenchmarkResult", "benchmark_runner"]


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _feeds_for_batch(runner: ModelRunner, spec: CompileSpec, batch: int) -> dict[str, np.ndarray] | None:
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
    sizes = list(settings.batch_sizes)
    fixed = runner.inputs[0].shape[0] if runner.inputs and runner.inputs[0].shape else None
    if fixed is not None and fixed not in sizes:
        sizes = [fixed]
    for batch in sizes:
        feeds = _feeds_for_batch(runner, spec, batch)
        if feeds is None:
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
            )
        )
    return results
