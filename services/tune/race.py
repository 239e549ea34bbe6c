"""Racing: time candidates in blocks of rounds and stop timing those that cannot win.

After ``RACE_AFTER`` rounds, a candidate leaves the race when the bootstrap 95% interval of
its p50 starts above the leader's interval by more than ``MARGIN`` of it: more rounds would
not make it the recommendation. The leader is the fastest candidate whose p99 so far meets
the SLO (none is dropped while none meets it), per sample for the throughput objective. The
last two stay in to the end, so the recommendation and its runner-up are compared on every
round. A dropped candidate keeps the figures of the rounds it ran, and says when it left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.benchmark import time_interleaved
from services.runners import ModelRunner
from services.tune.stats import bootstrap_ci

__all__ = ["BLOCK", "MARGIN", "RACE_AFTER", "RaceResult", "race"]

BLOCK = 10
RACE_AFTER = 20
MARGIN = 0.10


@dataclass
class RaceResult:
    """Seconds per round for each entry (shorter rows for dropped ones), and why each dropped one left."""

    rows: list[list[float]]
    dropped: dict[int, str] = field(default_factory=dict)
    rounds: int = 0


def _dropouts(
    live: list[int], rows: list[list[float]], batches: Sequence[int], max_p99_ms: float | None
) -> dict[int, str]:
    per_sample = {i: np.asarray(rows[i]) * 1e3 / batches[i] for i in live}
    meets = [i for i in live if max_p99_ms is None or np.percentile(per_sample[i] * batches[i], 99) <= max_p99_ms]
    if not meets:
        return {}
    leader = min(meets, key=lambda i: float(np.median(per_sample[i])))
    lead_hi = bootstrap_ci(per_sample[leader])[1]
    out = {}
    for i in live:
        if i == leader:
            continue
        lo = bootstrap_ci(per_sample[i])[0]
        if lo > lead_hi * (1 + MARGIN):
            out[i] = (
                f"left the race after {len(rows[i])} rounds: its p50 interval starts at {lo:.4f} ms/sample, "
                f"over {MARGIN:.0%} above the leader's upper bound {lead_hi:.4f}"
            )
    return out


def race(
    entries: Sequence[tuple[ModelRunner, dict[str, np.ndarray]]],
    batches: Sequence[int],
    *,
    warmup: int,
    rounds: int,
    keep_going: Callable[[], bool],
    max_p99_ms: float | None,
    enabled: bool = True,
    min_rounds: int = 5,
) -> RaceResult:
    """Time ``entries`` side by side in blocks of rounds; with ``enabled``, drop those that cannot win.

    ``keep_going`` (the budget) is asked between rounds once ``min_rounds`` have run.
    """
    result = RaceResult(rows=[[] for _ in entries])
    live = list(range(len(entries)))
    done = 0

    def guard(start: int) -> Callable[[], bool]:
        finished = 0

        def go_on() -> bool:  # asked before each round of a block but its first
            nonlocal finished
            finished += 1
            return start + finished < min_rounds or keep_going()

        return go_on

    while done < rounds and live:
        if done >= min_rounds and not keep_going():
            break
        block = min(BLOCK, rounds - done)
        times = time_interleaved(
            [entries[i] for i in live],
            warmup if done == 0 else 0,
            block,
            shuffle_seed=done,
            keep_going=guard(done),
        )
        for k, i in enumerate(live):
            result.rows[i].extend(float(t) for t in times[k])
        done += times.shape[1]
        if times.shape[1] < block:
            break  # the budget ran out inside the block
        if enabled and RACE_AFTER <= done < rounds and len(live) > 2:  # none leaves after its last round
            gone = _dropouts(live, result.rows, batches, max_p99_ms)
            for i in sorted(gone, key=lambda i: -np.median(result.rows[i]))[: max(0, len(live) - 2)]:
                result.dropped[i] = gone[i]
            live = [i for i in live if i not in result.dropped]
    result.rounds = done
    return result
