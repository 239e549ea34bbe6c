"""onnxruntime's SkipLayerNormalization CPU kernel against the Add + LayerNormalization it replaces.

Issue 12's cause: onnxruntime fuses a residual Add and LayerNormalization into
SkipLayerNormalization at load time whenever it knows both Add inputs have the same 3-D
shape. This measures the two forms side by side, each in a session at ORT_ENABLE_BASIC (so
the unfused one stays unfused), one thread, thread CPU time, order alternating per round;
ratio = fused / unfused, median (min-max) over rounds.

    .venv/bin/python benchmarks/bench_skip_layernorm.py [--rounds 9] [--seconds 0.2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kiln_testing.timing import in_blocks, ratio_cell  # noqa: E402


def _model(fused: bool, hidden: int) -> Any:
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", hidden])
    skip = helper.make_tensor_value_info("skip", TensorProto.FLOAT, ["batch", "sequence", hidden])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", hidden])
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.uniform(0.5, 1.5, hidden).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.uniform(-0.1, 0.1, hidden).astype(np.float32), "beta"),
    ]
    if fused:
        nodes = [
            helper.make_node(
                "SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["y"], domain="com.microsoft", epsilon=1e-12
            )
        ]
    else:
        nodes = [
            helper.make_node("Add", ["x", "skip"], ["sum"]),
            helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-12),
        ]
    graph = helper.make_graph(nodes, "residual_layernorm", [x, skip], [y], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _session(model: Any) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seconds", type=float, default=0.2)
    args = ap.parse_args()
    import onnxruntime as ort

    print(f"onnxruntime {ort.__version__}, 1 thread, thread CPU time, {args.rounds} rounds\n")
    print("| batch x sequence x hidden | Add + LayerNorm (ms) | SkipLayerNorm (ms) | SkipLayerNorm / Add + LayerNorm |")
    print("|---|---:|---:|---|")
    for batch, seq, hidden in ((1, 64, 256), (8, 64, 256), (8, 64, 768), (8, 128, 1024)):
        rng = np.random.default_rng(1)
        feed = {n: rng.standard_normal((batch, seq, hidden)).astype(np.float32) for n in ("x", "skip")}
        plain, fused = _session(_model(False, hidden)), _session(_model(True, hidden))
        np.testing.assert_allclose(fused.run(None, feed)[0], plain.run(None, feed)[0], rtol=1e-4, atol=1e-4)
        calls = {"plain": partial(plain.run, None, feed), "fused": partial(fused.run, None, feed)}
        ms = in_blocks(calls, args.rounds, args.seconds, at_least=20, warmup=1, clock=time.thread_time)
        a, b = ms["plain"], ms["fused"]
        print(
            f"| {batch} x {seq} x {hidden} | {statistics.median(a):.3f} | {statistics.median(b):.3f} "
            f"| {ratio_cell(b, a)} |"
        )


if __name__ == "__main__":
    main()
