"""The benchmark scripts as a whole: `make benchmarks` runs every one, tests and benchmarks share
kiln_testing rather than importing each other, and the shared timing takes turns as it says."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from kiln_testing.timing import in_blocks, median_ratio, ratio_cell, ratio_spread, run_by_run
from services.benchmark import time_interleaved

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_make_benchmarks_runs_every_script_once_with_its_arguments() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--list"], capture_output=True, text=True, check=True
    ).stdout
    listed = [line.split()[0] for line in out.splitlines()]
    assert sorted(listed) == sorted(p.name for p in BENCHMARKS.glob("bench_*.py"))
    assert len(listed) == len(set(listed))
    assert "bench_compile_cost.py --baseline {baseline} --size 64 --runs 3" in out.splitlines()


def test_no_test_imports_a_benchmark_script_and_no_package_imports_kiln_testing() -> None:
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    from_tests = {
        f"{p.name}: {m}"
        for p in (ROOT / "tests").glob("*.py")
        for m in _imported_modules(p)
        if m.split(".")[0] in scripts
    }
    assert from_tests == set()
    packages = [p for top in ("api", "cli", "services", "workers") for p in (ROOT / top).rglob("*.py")]
    into_testing = {
        f"{p.relative_to(ROOT)}: {m}"
        for p in packages
        for m in _imported_modules(p)
        if m.split(".")[0] in ("kiln_testing", "tests", "benchmarks")
    }
    assert into_testing == set()


class _Clock:
    """A clock that moves only when a fake runner runs, by that runner's cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Runner:
    def __init__(self, name: str, cost: float, clock: _Clock, log: list[str]) -> None:
        self.name, self.cost, self.clock, self.log = name, cost, clock, log

    def run(self, feeds: dict[str, np.ndarray]) -> None:
        self.log.append(self.name)
        self.clock.now += self.cost


def test_time_interleaved_times_each_run_by_the_clock_it_is_given() -> None:
    clock, log = _Clock(), []
    a, b = _Runner("a", 0.002, clock, log), _Runner("b", 0.005, clock, log)
    times = time_interleaved([(a, {}), (b, {})], 1, 3, clock=clock)
    assert times.shape == (2, 3)
    np.testing.assert_allclose(times, [[0.002] * 3, [0.005] * 3])
    assert log == ["a", "b"] + ["a", "b"] * 3


def test_run_by_run_takes_turns_rotating_who_goes_first_and_keeps_a_median_per_round() -> None:
    clock, log = _Clock(), []
    runners = [_Runner(n, c, clock, log) for n, c in (("a", 0.001), ("b", 0.004), ("c", 0.010))]
    medians = run_by_run([(r, {}) for r in runners], 2, 0.0, warmup=1, min_cycles=3, rotate=True, clock=clock)
    np.testing.assert_allclose(medians, [[1.0, 1.0], [4.0, 4.0], [10.0, 10.0]])  # ms, one per round
    cycles = ["abc", "bca", "cab"]
    assert "".join(log) == "abc" + "".join(cycles) * 2  # warm-up, then each round's cycles
    log.clear()
    run_by_run([(r, {}) for r in runners], 1, 0.0, warmup=0, min_cycles=2, clock=clock)
    assert "".join(log) == "abcabc"


def test_in_blocks_reverses_the_order_every_other_round() -> None:
    clock, log = _Clock(), []
    calls = {n: partial(_Runner(n, c, clock, log).run, {}) for n, c in (("x", 0.002), ("y", 0.003))}
    ms = in_blocks(calls, 3, 0.0, at_least=2, warmup=1, clock=clock)
    assert ms == {"x": pytest.approx([2.0, 2.0, 2.0]), "y": pytest.approx([3.0, 3.0, 3.0])}
    assert "".join(log) == "xxx" + "yyy" + "yyy" + "xxx" + "xxx" + "yyy"  # per block: a warm-up run, two timed


def test_ratios_are_taken_round_by_round() -> None:
    a, b = [2.0, 3.0, 9.0], [1.0, 2.0, 3.0]  # per round: 2.0, 1.5, 3.0
    assert median_ratio(a, b) == 2.0
    assert ratio_spread(a, b) == (2.0, 1.5, 3.0)
    assert ratio_cell(a, b) == "2.00 (1.50-3.00)"
    assert ratio_cell(a, b, ".3f") == "2.000 (1.50-3.00)"
    assert ratio_cell([1000.0], [3.0], ".3g", ".3g") == "333 (333-333)"
