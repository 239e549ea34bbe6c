"""Benchmark the TensorRT pre-flight; prints a markdown table (see docs/benchmarks.md).

The pre-flight's promise is to fail a model TensorRT cannot import *early*: on the CPU
queue, before a GPU worker is involved. This measures what that costs against the floor
of reading a model at all — ``onnx.load`` + ``onnx.checker.check_model`` + shape inference,
the baseline any ONNX step pays — on the tests' tiny CNN and transformer block and on a
synthetic deep graph (many small nodes, the pre-flight's worst case per byte). Also the
symmetric int8 Q/DQ preparation, the only CPU-heavy part of an int8 TensorRT build.

Variants alternate inside each round; the median over ``--rounds`` is reported.

    .venv/bin/python benchmarks/bench_tensorrt_preflight.py [--rounds 7] [--depth 2000]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def deep_model(path: Path, depth: int) -> Path:
    """A chain of ``depth`` blocks (MatMul, Add, Relu, Reshape) on a [batch, 64] input."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits = [], []
    prev = "x"
    inits.append(numpy_helper.from_array(np.array([-1, 64], np.int64), "shape"))
    for i in range(depth):
        w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32) * 0.1, f"w{i}")
        b = numpy_helper.from_array(np.zeros(64, np.float32), f"b{i}")
        inits += [w, b]
        nodes += [
            helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"r{i}"]),
            helper.make_node("Reshape", [f"r{i}", "shape"], [f"h{i}"]),
        ]
        prev = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "deep",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["batch", 64])],
        initializer=inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def baseline(path: Path) -> None:
    import onnx

    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    onnx.shape_inference.infer_shapes(model)


def kiln_preflight(path: Path) -> None:
    from services.tensorrt.preflight import require_tensorrt_support

    require_tensorrt_support(path, tensorrt_major=11)


def timed(fn: Callable[[Path], None], path: Path) -> float:
    t0 = time.perf_counter()
    fn(path)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--depth", type=int, default=2000)
    args = parser.parse_args()

    import onnx

    from kiln_testing.models import tiny_cnn_onnx, tiny_transformer_onnx
    from services.tensorrt.qdq import make_qdq_model

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        models = {
            "tiny CNN": tiny_cnn_onnx(tmp / "cnn.onnx"),
            "transformer block": tiny_transformer_onnx(tmp / "tr.onnx"),
            f"deep chain ({args.depth} blocks)": deep_model(tmp / "deep.onnx", args.depth),
        }
        for path in models.values():  # warm imports and caches
            baseline(path)
            kiln_preflight(path)
        print(
            f"machine: {platform.machine()} {platform.processor() or ''}, python {platform.python_version()}, "
            f"onnx {onnx.__version__}, rounds {args.rounds}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
        )
        print("| model | nodes | baseline: load + check + infer (ms) | Kiln pre-flight (ms) | ratio |")
        print("|---|---:|---:|---:|---:|")
        for label, path in models.items():
            base, pre = [], []
            for _ in range(args.rounds):
                base.append(timed(baseline, path))
                pre.append(timed(kiln_preflight, path))
            b, p = statistics.median(base), statistics.median(pre)
            nodes = len(onnx.load(str(path), load_external_data=False).graph.node)
            print(f"| {label} | {nodes} | {b * 1e3:.1f} | {p * 1e3:.1f} | {p / b:.2f} |")

        print("\n| model | Q/DQ int8 preparation, 32 calibration samples (ms) |")
        print("|---|---:|")
        rng = np.random.default_rng(0)
        shapes = {"tiny CNN": (1, 3, 32, 32), "transformer block": (1, 16, 32)}
        for label, shape in shapes.items():
            feeds = [{"input": rng.standard_normal(shape).astype(np.float32)} for _ in range(32)]
            times = []
            for r in range(max(3, args.rounds // 2)):
                t0 = time.perf_counter()
                make_qdq_model(models[label], tmp / f"q{r}.onnx", feeds, tmp / f"w{r}")
                times.append(time.perf_counter() - t0)
            print(f"| {label} | {statistics.median(times) * 1e3:.0f} |")


if __name__ == "__main__":
    main()
