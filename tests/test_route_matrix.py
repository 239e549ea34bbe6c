"""The architecture matrix (benchmarks/bench_route_matrix.py, kiln_testing/route_matrix.py) runs every CPU target.

The matrix itself is a benchmark (minutes of compiling, results in docs/benchmarks.md); this
checks only how it picks its targets and names its failed cells, so a target registered on
another branch joins it once merged, and a GPU-only or uninstalled engine is named, not dropped.
"""

from __future__ import annotations

import importlib.util

from kiln_testing import route_matrix as matrix
from services.descriptors import EngineDescriptor, Registry, TargetDescriptor, WorkerImage, _discover, registry


def test_the_matrix_runs_every_registered_cpu_target_whose_engine_is_installed() -> None:
    runnable, excluded = matrix.target_table()
    reg = registry()
    assert runnable == [t for t in reg.targets if t in runnable]  # the registry's order
    assert set(runnable) | set(excluded) == set(reg.targets)
    assert "tensorrt" in excluded and "needs a GPU" in excluded["tensorrt"]
    for name in runnable:
        engine = reg.engines[reg.targets[name].engine]
        assert engine.image.gpus == 0
        assert all(importlib.util.find_spec(m) is not None for m in engine.modules), name
    assert "onnxruntime" in runnable


def test_a_target_registered_later_joins_the_matrix_and_a_missing_engine_is_named() -> None:
    def engine(name: str, module: str) -> EngineDescriptor:
        return EngineDescriptor(name, name, (module,), name, (), WorkerImage(extras=(name,)))

    def target(name: str) -> TargetDescriptor:
        return TargetDescriptor(name, name, {"onnx": 1.0}, "m:f", "onnx", name)

    extra: list[EngineDescriptor | TargetDescriptor] = [
        engine("newcpu", "json"),
        target("newcpu"),
        engine("absent", "no_such_module_kiln"),
        target("absent"),
    ]
    runnable, excluded = matrix.target_table(Registry.build([*_discover(), ("test", extra)]))
    assert runnable[-1] == "newcpu"
    assert "absent" not in runnable and "no_such_module_kiln" in excluded["absent"]


def test_failed_cells_are_named_limits_bugs_or_unexplained() -> None:
    failed = {"status": "failed", "code": "CONVERSION_FAILED", "message": "x"}
    rows = [
        {"source": "torch LSTM over rows (ONNX)", "seconds": 1.0, "cells": {"tflite": failed, "mnn": failed}},
        {
            "source": "something new",
            "seconds": 1.0,
            "cells": {"tflite": failed, "mnn": {"status": "succeeded", "rank": 1}},
        },
    ]
    md = matrix.markdown(rows, ["tflite", "mnn"], {"tensorrt": "needs a GPU"})
    assert "`CONVERSION_FAILED` (limit)" in md and "`CONVERSION_FAILED` **(bug)**" in md
    assert "**(unexplained)**" in md and "| **pass rate** | 0/2 | 1/2 | |" in md
    assert "Passed 1 of 4 cells (25.0 %" in md and "- tensorrt: needs a GPU" in md
    head = "every route to mnn failed: (1) a → b: PARITY_FAILED in export:mnn (export_mnn): "
    assert matrix.short_reason(
        head + "top-1 50%; (2) a → c: PARITY_FAILED in export:mnn@2 (export_mnn): top-1 40%"
    ) == ("top-1 50%; (2) top-1 40%")
