"""Side-by-side timing and per-round ratios for the benchmark scripts' tables.

On a shared machine only figures taken side by side mean anything: every script times its
variants in rounds, each round keeps each variant's median, and a ratio is taken round by
round (a/b of one round's medians) and reported as its median and range over the rounds.

Two ways of interleaving, as the scripts need them:

- :func:`run_by_run`: variants take turns one run at a time (A B C, A B C, ...), through
  :func:`services.benchmark.time_interleaved`, the loop ``kiln tune`` and the exporters'
  fp32 comparison use. For runners (anything with ``run(feeds)``).
- :func:`in_blocks`: each variant runs for a block of ``seconds`` before the next, the order
  reversed every other round. For sessions and callables whose runs are short enough that a
  block of them is the thing to time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from services.benchmark import time_interleaved

__all__ = ["block_median_ms", "in_blocks", "median_ratio", "ratio_cell", "ratio_spread", "ratios", "run_by_run"]

K = TypeVar("K", bound=Hashable)


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Return a/b round by round (the two lists are one figure per round, in the same rounds)."""
    return [x / y for x, y in zip(a, b, strict=True)]


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Return the median over rounds of a/b."""
    return statistics.median(ratios(a, b))


def ratio_spread(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """Return the median, min and max over rounds of a/b."""
    rs = ratios(a, b)
    return statistics.median(rs), min(rs), max(rs)


def ratio_cell(a: Sequence[float], b: Sequence[float], median: str = ".2f", spread: str = ".2f") -> str:
    """Return a table cell "median (min-max)" of a/b over rounds, in the given formats."""
    mid, lo, hi = ratio_spread(a, b)
    return f"{mid:{median}} ({lo:{spread}}-{hi:{spread}})"


def run_by_run(
    entries: Sequence[tuple[Any, dict[str, np.ndarray]]],
    rounds: int,
    seconds: float,
    *,
    warmup: int = 3,
    min_cycles: int = 0,
    rotate: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> list[list[float]]:
    """Return each entry's median ms per round; entries (runner, feeds) take turns one run at a time.

    Each entry first runs ``warmup`` times on its own. A round is a series of cycles, each
    running every entry once, until it has had ``min_cycles`` cycles and lasted ``seconds`` per
    entry. With ``rotate``, each cycle starts one entry later than the one before (A B C, B C A,
    ...), so no entry always goes first. ``clock`` times each run (wall time unless told).
    """
    for runner, feeds in entries:
        for _ in range(warmup):
            runner.run(feeds)
    n = len(entries)
    out: list[list[float]] = [[] for _ in entries]
    for _ in range(rounds):
        cycles: list[np.ndarray] = []
        start = time.perf_counter()
        while len(cycles) < min_cycles or time.perf_counter() - start < seconds * n:
            shift = len(cycles) % n if rotate else 0
            took = time_interleaved([*entries[shift:], *entries[:shift]], 0, 1, clock=clock)[:, 0]
            cycles.append(np.roll(took, shift))  # back in the entries' order
        per_entry = np.array(cycles).T
        for ms, times in zip(out, per_entry, strict=True):
            ms.append(statistics.median(times.tolist()) * 1e3)
    return out


def block_median_ms(
    call: Callable[[], object],
    seconds: float,
    *,
    at_least: int = 5,
    warmup: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Return the median ms (by ``clock``) of as many calls as fit in ``seconds``, at least ``at_least``."""
    for _ in range(warmup):
        call()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < at_least or time.perf_counter() - start < seconds:
        t0 = clock()
        call()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def in_blocks(
    calls: Mapping[K, Callable[[], object]],
    rounds: int,
    seconds: float,
    *,
    at_least: int = 5,
    warmup: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[K, list[float]]:
    """Return each call's median ms per round; each runs a block (:func:`block_median_ms`) in turn.

    The order is reversed every other round (A B C, C B A, ...), so load that drifts across a
    round hits every variant alike over two rounds.
    """
    out: dict[K, list[float]] = {k: [] for k in calls}
    keys = list(calls)
    for r in range(rounds):
        for key in keys if r % 2 == 0 else reversed(keys):
            out[key].append(block_median_ms(calls[key], seconds, at_least=at_least, warmup=warmup, clock=clock))
    return out
