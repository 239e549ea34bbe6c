"""`kiln compile` of a model with large weights: this checkout against another, side by side.

    .venv/bin/python benchmarks/bench_large_model.py --baseline DIR [--mib 512] [--runs 3]

The model is one MatMul with a square float32 weight of about ``--mib`` MiB (random), so the
time goes into what Kiln does with the bytes (hashing, storing each step's output,
publishing) rather than into computing. Both checkouts run the same command turn by turn
(baseline first, then this, ...) with their own empty cache, benchmark and parity sample
count kept small; the table gives the median wall time and the ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILN = ROOT / ".venv" / "bin" / "kiln"


def make_model(path: Path, mib: int) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    n = int((mib * 2**20 / 4) ** 0.5)
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        initializer=[weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path), save_as_external_data=False)


def compile_once(model: Path, work: Path, tree: Path | None) -> float:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    spec = work / "spec.json"
    spec.write_text('{"benchmark": false, "validation": {"samples": 2}}')
    started = time.perf_counter()
    subprocess.run(
        [
            str(KILN),
            "compile",
            str(model),
            "-t",
            "onnxruntime",
            "--spec",
            str(spec),
            "--repo",
            str(work / "repo"),
            "--name",
            "big",
            "--cache-dir",
            str(work / "cache"),
            "-q",
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout (its code runs via PYTHONPATH)")
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(
        prefix="bench-large-", dir=ROOT.parent if os.access(ROOT.parent, os.W_OK) else None
    ) as tmp:
        root = Path(tmp)
        model = root / "big.onnx"
        make_model(model, args.mib)
        size = model.stat().st_size / 2**20
        times: dict[str, list[float]] = {"baseline": [], "this": []}
        for i in range(args.runs):
            for label, tree in (("baseline", args.baseline.resolve()), ("this", None)):
                work = root / f"{label}-{i}"
                work.mkdir()
                times[label].append(compile_once(model, work, tree))
                shutil.rmtree(work)
        base, this = statistics.median(times["baseline"]), statistics.median(times["this"])
        print("| model | runs | baseline s (median) | this s (median) | this / baseline |")
        print("|---|---:|---:|---:|---:|")
        print(
            f"| MatMul, {size:.0f} MiB weight, onnxruntime fp32 | {args.runs} | {base:.2f} | {this:.2f} | {this / base:.2f} |"
        )
        print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    sys.exit(main())
