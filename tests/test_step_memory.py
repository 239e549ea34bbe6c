"""Peak resident memory per step: measured per step (not the process's lifetime peak) and recorded in the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from services.pipeline.memory import StepMemory, peak_rss_bytes, reset_peak_rss, rss_bytes

MIB = 1 << 20


def test_peak_is_reset_between_steps() -> None:
    # The first "step" touches 256 MiB and frees it; the second touches nothing. Without the
    # reset the second would report the first's peak (what ru_maxrss does).
    assert reset_peak_rss(), "Linux lets a process reset its own peak RSS"
    first = StepMemory.start()
    block = np.ones(256 * MIB, dtype=np.uint8)  # np.ones writes every page: all resident
    assert block[-1] == 1
    del block
    big = first.record()
    assert big["peak_rss_mb"] - big["rss_before_mb"] >= 200, big
    second = StepMemory.start()
    small = second.record()
    assert small["peak_rss_mb"] - small["rss_before_mb"] < 64, small
    assert "peak_rss_is_lifetime" not in small
    assert peak_rss_bytes() >= rss_bytes() > 0


def test_manifest_records_each_steps_peak_rss(cnn_onnx: Path, store, repository, repo_dir: Path) -> None:
    from services.pipeline import compile_model
    from services.spec import CompileSpec

    spec = CompileSpec.model_validate(
        {"targets": ["onnxruntime"], "benchmark": False, "validation": {"samples": 2}, "name": "cnn"}
    )
    result = compile_model(cnn_onnx, spec, store=store, repository=repository, use_cache=False)
    assert result.ok, result.targets
    manifest = json.loads(next(repo_dir.glob("triton/*/*/kiln-manifest.json")).read_text())
    kinds = {rec["kind"] for rec in manifest["steps"]}
    assert {"reference", "export"} <= kinds, kinds
    for rec in manifest["steps"]:
        # A real measurement of this process: at least what Python with numpy and onnx holds,
        # and never below what it held when the step began.
        assert rec["peak_rss_mb"] > 30, rec
        assert rec["peak_rss_mb"] >= rec["rss_before_mb"] > 0, rec
