"""Time every passing candidate side by side, round by round, alone on the host, with the spread.

All candidates are open at once and :func:`services.benchmark.time_interleaved` runs each once
per round in a shuffled order, so a change in the machine's load (other jobs, thermal) hits
them alike and the rounds pair up across candidates. The timing holds the host alone as
benchmarks do (services/steps/host_gate.py): no compile step of this host runs meanwhile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from services.benchmark import feeds_for_batch
from services.formats import Format
from services.runners import ModelRunner, open_runner
from services.spec import CompileSpec
from services.steps.host_gate import host_alone
from services.tune.budget import Deadline
from services.tune.race import race
from services.tune.report import Candidate
from services.tune.space import runner_options
from services.tune.stats import bootstrap_ci

__all__ = ["measure_candidates", "open_candidate"]

#: Rounds every timed candidate gets even when the budget has run out (fewer say nothing about p99).
MIN_ROUNDS = 5


def open_candidate(c: Candidate, artifact_format: str, **extra: Any) -> ModelRunner:
    """Open ``c``'s artifact with the runner options of its settings (and ``extra`` ones, e.g. profiling)."""
    assert c.artifact is not None
    options = {k: v for k, v in runner_options(c.target, c.settings).items() if v is not None}
    return open_runner(Format(artifact_format), Path(c.artifact), **options, **extra)


def measure_candidates(
    candidates: list[Candidate],
    formats: dict[str, str],
    spec: CompileSpec,
    *,
    rounds: int,
    warmup: int,
    deadline: Deadline,
    max_p99_ms: float | None = None,
    racing_enabled: bool = False,
) -> dict[str, Any]:
    """Time the candidates (``status == "timed"`` on entry: built and passing) side by side; fill their figures.

    ``formats`` maps a target to its artifact format. A candidate whose runner refuses its
    settings, or whose batch axis is fixed to another size, leaves the race with a reason.
    With ``racing_enabled`` candidates that cannot win stop being timed early (services/tune/race.py).
    Returns how the measurement went (rounds run, host alone, stopped by the budget, left the race).
    """
    entries: list[tuple[ModelRunner, dict[str, np.ndarray]]] = []
    racing: list[Candidate] = []
    try:
        for c in candidates:
            if c.status != "timed":
                continue
            try:
                runner = open_candidate(c, formats[c.target])
            except Exception as exc:  # an engine refusing a setting must not end the search
                c.status, c.passed, c.reason = "failed", False, f"cannot open with {c.settings}: {exc}"[:500]
                continue
            feeds = feeds_for_batch(runner, spec, c.batch)
            if feeds is None:
                runner.close()
                c.status, c.passed, c.reason = "skipped", False, f"its batch axis is fixed: batch {c.batch} cannot run"
                continue
            entries.append((runner, feeds))
            racing.append(c)
        if not entries:
            return {"rounds": 0, "warmup": warmup, "alone": None, "stopped_by_budget": False}
        with host_alone() as quiet:
            raced = race(
                entries,
                [c.batch for c in racing],
                warmup=warmup,
                rounds=rounds,
                keep_going=lambda: not deadline.passed(),
                max_p99_ms=max_p99_ms,
                enabled=racing_enabled,
                min_rounds=MIN_ROUNDS,
            )
    finally:
        for runner, _ in entries:
            runner.close()
    for i, c in enumerate(racing):
        row = np.asarray(raced.rows[i])
        if i in raced.dropped:
            c.reason = raced.dropped[i]
        ms = row * 1e3
        p25, p50, p75, p99 = (float(v) for v in np.percentile(ms, [25, 50, 75, 99]))
        c.p50_ms, c.p99_ms, c.p25_ms, c.p75_ms = p50, p99, p25, p75
        c.iqr_ms = p75 - p25
        c.p50_ci_ms = bootstrap_ci(ms)
        c.mean_ms = float(ms.mean())
        c.throughput = float(c.batch / row.mean())
        c.rounds = int(row.size)
        c.times = [float(t) for t in row]
        c.passed = True
    done = raced.rounds
    return {
        "rounds": done,
        "racing": racing_enabled,
        "left_the_race": len(raced.dropped),
        "rounds_planned": rounds,
        "warmup": warmup,
        "interleaved": True,
        "order": "shuffled each round (seed 0)",
        "alone": quiet.alone,
        "waited_for_host_s": quiet.waited_s,
        "stopped_by_budget": done < rounds,
        "timed_candidates": len(racing),
    }
