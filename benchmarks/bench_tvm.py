"""TVM against onnxruntime on the same models: untuned, fp16 and MetaSchedule-tuned, as latency ratios.

For each model (the tests' CNN and transformer block, and the wider ones bench_openvino.py
times), optimised by Kiln's ONNX passes as the pipeline does before any target, at batch 1: onnxruntime (CPU EP, default graph optimisations) on the ONNX model, and
the tvm target's CPU library built by ``services.tvm.build_libraries`` at fp32 untuned, fp16
untuned, and fp32 tuned with ``--trials`` MetaSchedule trials (static batch-1 shapes). The
runners take turns in blocks of ``--seconds`` each, ``--rounds`` times, the order reversed
every other round, so every engine sees the same machine load; the table gives the median of
each runner's block medians, and each TVM variant's ratio to onnxruntime as the median (and
range) over rounds (below 1: TVM faster).

Blocks, not one run each in turn: both engines' thread pools spin after a run, and taking turns
run by run each engine waits for the other's spinning threads to be preempted (measured on the
tuned transformer block: TVM 39.9 ms run by run against 1.18 ms in blocks, onnxruntime 2.15 ms
against 1.30 ms). A serving process runs one engine.

    python benchmarks/bench_tvm.py [--trials 64] [--rounds 8] [--seconds 0.5] [--only cnn]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from kiln_testing.timing import in_blocks, ratio_spread  # noqa: E402


def _build(onnx_path: Path, out: Path, *, fp16: bool, trials: int, shape: tuple[int, ...], name: str) -> float:
    from services.spec import InputSpec
    from services.tvm import TvmOptions, build_libraries

    out.mkdir(parents=True)
    started = time.monotonic()
    details = build_libraries(
        onnx_path,
        out,
        fp16=fp16,
        options=TvmOptions(tuning_trials=trials),
        spec_inputs={name: InputSpec(shape=list(shape))} if trials else {},
        scratch=out.parent / f"{out.name}-scratch",
    )
    (out / "tuning.json").write_text(json.dumps(details.get("tuning", {})))
    return time.monotonic() - started


def _time_in_blocks(
    runners: dict[str, Any], feed: dict[str, np.ndarray], rounds: int, seconds: float
) -> dict[str, list[float]]:
    """Return each runner's block median ms, one per round (see the module's docstring for why blocks)."""
    return in_blocks({k: (lambda r=r: r.run(feed)) for k, r in runners.items()}, rounds, seconds, warmup=10)


def _cell(blocks: dict[str, list[float]], key: str) -> str:
    """Return "p50 (ratio to onnxruntime, its range over rounds)" for one TVM variant."""
    mid, lo, hi = ratio_spread(blocks[key], blocks["ort"])
    return f"{float(np.median(blocks[key])):.3f} ({mid:.2f}x, {lo:.2f}-{hi:.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=64, help="MetaSchedule trials for the tuned library")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of blocks (each runner one block per round)")
    parser.add_argument("--seconds", type=float, default=0.5, help="length of one runner's block")
    parser.add_argument("--only", help="benchmark only models whose label contains this")
    parser.add_argument(
        "--tuned-only", action="store_true", help="time onnxruntime against the tuned library alone (no untuned builds)"
    )
    args = parser.parse_args()
    from bench_openvino import build_models

    from services.formats import Format
    from services.onnx_io import load_onnx, save_onnx
    from services.passes import optimize_model
    from services.runners import open_runner
    from services.tvm.host import configure_threads

    print(
        f"cpus: {os.cpu_count()}, TVM threads {configure_threads()}, load average {os.getloadavg()[0]:.1f}, "
        f"tuning trials {args.trials}\n"
    )
    print(
        "| model | onnxruntime p50 ms | tvm fp32 p50 ms (ratio) | tvm fp16 (ratio) | tvm tuned fp32 (ratio) "
        "| build s untuned / tuned | tuning |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-tvm-") as tmp:
        for label, raw, shape in build_models(Path(tmp)):
            if args.only and args.only not in label:
                continue
            optimized, _report = optimize_model(load_onnx(raw))
            path = raw.with_name(raw.stem + "-optimized.onnx")
            save_onnx(optimized, path)
            ort = open_runner(Format.ONNX, path)
            name = ort.inputs[0].name
            builds = {}
            folder = Path(tmp) / path.stem
            if not args.tuned_only:
                builds["fp32"] = _build(path, folder / "fp32", fp16=False, trials=0, shape=shape, name=name)
                builds["fp16"] = _build(path, folder / "fp16", fp16=True, trials=0, shape=shape, name=name)
            builds["tuned"] = _build(path, folder / "tuned", fp16=False, trials=args.trials, shape=shape, name=name)
            runners = {"ort": ort, **{k: open_runner(Format("tvm_library"), folder / k / "model.so") for k in builds}}
            feed = {name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
            ref = ort.run(feed)
            for key in builds:  # a wrong library timed fast would be no result
                got = runners[key].run(feed)
                for out_name, value in ref.items():
                    cos = float(np.dot(got[out_name].ravel(), value.ravel()))
                    cos /= float(np.linalg.norm(got[out_name]) * np.linalg.norm(value)) or 1.0
                    assert cos > 0.999, f"{label} {key}: cosine {cos}"
            blocks = _time_in_blocks(runners, feed, args.rounds, args.seconds)
            cells = [_cell(blocks, k) if k in blocks else "-" for k in ("fp32", "fp16", "tuned")]
            untuned = f"{builds['fp32']:.1f}" if "fp32" in builds else "-"
            tuning = json.loads((folder / "tuned" / "tuning.json").read_text())
            print(
                f"| {label} | {float(np.median(blocks['ort'])):.3f} | "
                + " | ".join(cells)
                + f" | {untuned} / {builds['tuned']:.1f} | {tuning.get('cost_model')}, {tuning.get('reused')} of "
                f"{tuning.get('tasks')} kernels reused, kept {tuning.get('speed_check', {}).get('kept')} |",
                flush=True,
            )
            for r in runners.values():
                r.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
