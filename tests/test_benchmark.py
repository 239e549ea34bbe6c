"""The benchmark recorded with every artifact: percentiles, throughput, batch sizes, warm-up left out."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from services.benchmark import benchmark_runner
from services.pipeline import compile_model
from services.runners.base import ModelRunner, TensorSpec
from services.spec import load_spec


class _ScriptedRunner(ModelRunner):
    """A runner whose first ``slow`` calls take 200 ms and the rest ~1 ms per sample.

    Not an engine: it gives the timing code durations known in advance, so the test can
    tell whether warm-up runs leaked into the percentiles.
    """

    def __init__(self, slow: int, batch_axis: int | None = None) -> None:
        self.inputs = [TensorSpec("x", "float32", (batch_axis, 4))]
        self.outputs = [TensorSpec("y", "float32", (batch_axis, 4))]
        self.slow = slow
        self.batches: list[int] = []

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = feeds["x"]
        self.batches.append(x.shape[0])
        time.sleep(0.2 if len(self.batches) <= self.slow else 0.001 * x.shape[0])
        return {"y": x}


def _spec(batch_sizes: list[int], warmup: int, iterations: int):
    return load_spec(
        {
            "targets": ["onnxruntime"],
            "benchmark": {"batch_sizes": batch_sizes, "warmup": warmup, "iterations": iterations},
        }
    )


def test_warmup_is_excluded_and_each_batch_size_gets_its_row() -> None:
    runner = _ScriptedRunner(slow=3)
    spec = _spec([1, 4], warmup=3, iterations=20)
    rows = benchmark_runner(runner, spec)
    assert [r.batch_size for r in rows] == [1, 4]
    assert runner.batches == [1] * 23 + [4] * 23  # warm-up and timed runs, per batch size
    one, four = rows
    assert one.p99_ms < 150, one  # the three 200 ms warm-up runs are not in the numbers
    assert one.p50_ms <= one.p90_ms <= one.p99_ms and one.iterations == 20 and one.warmup == 3
    assert four.p50_ms > one.p50_ms  # 4 ms against 1 ms of sleep per call
    for r in rows:  # samples per second over the mean time of one call
        assert abs(r.throughput - r.batch_size * 1000 / r.mean_ms) < 1e-6 * r.throughput


def test_a_model_with_a_fixed_batch_runs_its_own_size() -> None:
    runner = _ScriptedRunner(slow=0, batch_axis=2)
    rows = benchmark_runner(runner, _spec([1, 8], warmup=1, iterations=5))
    assert [r.batch_size for r in rows] == [2] and set(runner.batches) == {2}


def test_every_batch_size_is_recorded_with_the_artifact(cnn_onnx: Path, store, repository) -> None:
    spec = load_spec(
        {
            "targets": ["onnxruntime"],
            "name": "bench",
            "benchmark": {"batch_sizes": [1, 4], "warmup": 2, "iterations": 10},
        }
    )
    target = compile_model(cnn_onnx, spec, store=store, repository=repository).targets["onnxruntime"]
    assert target.status == "succeeded", target.error
    rows = target.benchmark
    assert [r["batch_size"] for r in rows] == [1, 4]
    for r in rows:
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] and r["iterations"] == 10 and r["warmup"] == 2
        assert r["throughput"] > 0
        assert r["alone"] is True  # nothing else ran on the host: timed alone (host_gate)


def _default_spec(**extra):
    return load_spec({"targets": ["onnxruntime"], "benchmark": {"warmup": 1, "iterations": 3}, **extra})


def test_default_batch_sizes_are_one_and_the_largest_allowed_up_to_8() -> None:
    assert _default_spec().benchmark_batch_sizes == [1, 8]
    assert _default_spec(max_batch_size=4).benchmark_batch_sizes == [1, 4]
    assert _default_spec(max_batch_size=0).benchmark_batch_sizes == [1, 8]  # batching off in Triton only
    profile = {"x": {"min": [1, 4], "opt": [2, 4], "max": [3, 4]}}
    assert _default_spec(inputs=profile).benchmark_batch_sizes == [1, 3]
    one = {"x": {"min": [1, 4], "opt": [1, 4], "max": [1, 4]}}
    assert _default_spec(inputs=one).benchmark_batch_sizes == [1]

    runner = _ScriptedRunner(slow=0)
    rows = benchmark_runner(runner, _default_spec())
    assert [r.batch_size for r in rows] == [1, 8]
    assert [r.shapes for r in rows] == [{"x": [1, 4]}, {"x": [8, 4]}]  # what was timed, on record


class _BatchOneOnly(_ScriptedRunner):
    """Declares an open batch axis but fails above 1, as some exports with a fixed reshape do."""

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if feeds["x"].shape[0] != 1:
            raise RuntimeError("Reshape: cannot reshape [8,4] to [1,4]")
        return super().run(feeds)


def test_a_default_size_the_model_cannot_run_is_left_out_but_a_chosen_one_fails() -> None:
    rows = benchmark_runner(_BatchOneOnly(slow=0), _default_spec())
    assert [r.batch_size for r in rows] == [1]
    try:
        benchmark_runner(_BatchOneOnly(slow=0), _spec([1, 8], warmup=1, iterations=3))
    except RuntimeError as exc:
        assert "Reshape" in str(exc)
    else:
        raise AssertionError("an explicitly asked batch size must not be skipped silently")


class _Fixed(ModelRunner):
    """Takes ``ms`` per call and logs who ran, so the test can see the interleaving."""

    def __init__(self, ms: float, log: list[str], tag: str) -> None:
        self.inputs = [TensorSpec("x", "float32", (None, 4))]
        self.outputs = [TensorSpec("y", "float32", (None, 4))]
        self.ms, self.log, self.tag = ms, log, tag

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.log.append(self.tag)
        time.sleep(self.ms / 1000)
        return {"y": feeds["x"]}


def test_compare_with_fp32_interleaves_and_says_which_to_deploy() -> None:
    from services.benchmark import compare_with_fp32

    log: list[str] = []
    spec = _spec([1, 4], warmup=1, iterations=4)
    fast = compare_with_fp32(_Fixed(2, log, "int8"), _Fixed(8, log, "fp32"), spec, "int8", [1, 4])
    assert log[:4] == ["int8", "fp32", "int8", "fp32"]  # side by side, not one after the other
    assert [r["batch_size"] for r in fast["rows"]] == [1, 4]
    assert all(2.0 < r["speedup"] < 5.0 for r in fast["rows"])  # 8 ms against 2 ms, give or take the sleep
    assert (fast["verdict"], fast["deploy"]) == ("faster", "int8")
    slow = compare_with_fp32(_Fixed(8, [], "fp16"), _Fixed(2, [], "fp32"), spec, "fp16", [1])
    assert (slow["verdict"], slow["deploy"]) == ("slower", "fp32") and slow["rows"][0]["speedup"] < 0.5


def test_reduced_precision_is_timed_against_fp32_and_the_verdict_is_recorded(cnn_onnx: Path, store, repository) -> None:
    from services.repository.publish import read_manifest

    spec = load_spec(
        {"targets": ["onnxruntime"], "name": "q", "precision": "int8", "benchmark": {"warmup": 2, "iterations": 10}}
    )
    target = compile_model(cnn_onnx, spec, store=store, repository=repository).targets["onnxruntime"]
    assert target.status == "succeeded", target.error
    vs = target.vs_fp32
    assert [r["batch_size"] for r in vs["rows"]] == [1, 8]
    for r in vs["rows"]:
        assert r["p50_ms"] > 0 and r["fp32_p50_ms"] > 0 and abs(r["speedup"] - r["fp32_p50_ms"] / r["p50_ms"]) < 1e-9
    assert vs["verdict"] in ("faster", "same", "slower")
    assert vs["deploy"] == ("int8" if vs["verdict"] == "faster" else "fp32")
    assert read_manifest(repository, "q", 1)["vs_fp32"] == vs


def test_require_no_slower_than_fp32_fails_the_target(cnn_onnx: Path, store, repository, monkeypatch) -> None:
    import services.exporters._common as common

    slower = {
        "precision": "fp16",
        "rows": [{"batch_size": 1, "p50_ms": 2.0, "fp32_p50_ms": 1.0, "speedup": 0.5}],
        "verdict": "slower",
        "deploy": "fp32",
        "reason": "fp16 is slower than fp32 at every batch size timed",
    }
    # Only to provoke the fault: real timings cannot be made slower on demand.
    monkeypatch.setattr(common, "compare_with_fp32", lambda *a, **k: slower)
    spec = load_spec(
        {
            "targets": ["onnxruntime"],
            "name": "s",
            "precision": "fp16",
            "benchmark": {"warmup": 1, "iterations": 3, "require_no_slower_than_fp32": True},
        }
    )
    target = compile_model(cnn_onnx, spec, store=store, repository=repository).targets["onnxruntime"]
    assert target.status == "failed" and target.error["code"] == "SLOWER_THAN_FP32"
    assert "2.000 ms against 1.000 ms at batch 1" in target.error["message"]
    assert target.error["details"]["vs_fp32"]["verdict"] == "slower" and target.published is None
