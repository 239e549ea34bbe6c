"""Benchmark Kiln's TFLite artifacts; prints markdown tables (see docs/benchmarks.md).

1. TFLite int8 against TFLite fp32 (both built by Kiln's exporter from the same SavedModel):
   latency ratio and artifact size ratio, for full-integer int8 (calibrated) and
   dynamic-range int8, with each artifact's agreement with the Keras model.
2. Kiln's Keras → TFLite against a direct ``TFLiteConverter.from_keras_model`` call on the
   same model, both starting from the .keras file on disk: conversion time ratio (goal:
   overhead under 10%) and output parity (both artifacts against Keras, and each other).

Latency: every variant runs through the same TFLiteRunner (LiteRT, ``--threads``); variants
take turns run by run inside each of ``--rounds`` rounds, so load from other processes on a
shared machine hits all of them alike; the ratio is taken per round and its median reported.
Conversion: Kiln and the direct call alternate, ``--conversions`` times each.

    .venv/bin/python benchmarks/bench_tflite.py [--rounds 7] [--seconds 0.5] [--threads 1] [--conversions 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from kiln_testing.timing import median_ratio, run_by_run  # noqa: E402


def build_models(tmp: Path) -> list[tuple[str, Path, tuple[int, ...]]]:
    """Return (label, .keras path, per-sample input shape) for each benchmarked model."""
    from kiln_testing.tf_models import IMAGE, MOBILENET_SHAPE, keras_cnn, mobilenet_v2

    return [
        ("Keras CNN 16x16 (tests' model)", keras_cnn(tmp / "cnn.keras"), IMAGE),
        ("MobileNetV2 96x96, 10 classes (weights=None)", mobilenet_v2(tmp / "mobilenet_v2.keras"), MOBILENET_SHAPE),
    ]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def agreement(outputs: list[np.ndarray], reference: list[np.ndarray]) -> dict[str, float]:
    """Return max |diff|, cosine and top-1 agreement of outputs against a reference, over samples."""
    a, b = np.concatenate(outputs), np.concatenate(reference)
    return {
        "max_abs": float(np.abs(a - b).max()),
        "cosine": cosine(a, b),
        "top1": float((a.argmax(1) == b.argmax(1)).mean()),
    }


def time_runs(
    runners: dict[str, Any], feed: dict[str, np.ndarray], rounds: int, seconds: float
) -> dict[str, list[float]]:
    """Return per-round median latency (ms) of each runner; runners alternate run by run."""
    medians = run_by_run([(r, feed) for r in runners.values()], rounds, seconds, warmup=5)
    return dict(zip(runners, medians, strict=True))


def precision_table(models, work: Path, args: argparse.Namespace) -> list[str]:
    from services.converters.tensorflow_native import write_keras_savedmodel
    from services.exporters.tflite import convert_savedmodel_to_tflite
    from services.runners.tensorflow import KerasRunner, load_keras_model
    from services.runners.tflite import TFLiteRunner
    from services.spec import Precision

    rows = [
        "| model | variant | size (bytes) | size vs fp32 | p50 latency (ms) | latency vs fp32 (median of rounds) "
        "| cosine vs Keras | top-1 vs Keras |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    rng = np.random.default_rng(0)
    for label, path, shape in models:
        keras_runner = KerasRunner(path)
        name = keras_runner.inputs[0].name
        saved = work / f"{path.stem}-sm"
        if not saved.exists():
            write_keras_savedmodel(load_keras_model(path), saved)
        calibration = [{name: rng.standard_normal((1, *shape)).astype(np.float32)} for _ in range(32)]
        held_out = [{name: rng.standard_normal((1, *shape)).astype(np.float32)} for _ in range(16)]
        want = [keras_runner.run(f)[keras_runner.outputs[0].name] for f in held_out]
        # The full-integer variant keeps int8 inputs and outputs (the spec's integer_io), as
        # measured in docs/benchmarks.md; Kiln's default full-integer artifact has float I/O.
        variants = {
            "fp32": (Precision.FP32, None),
            "int8 full-integer (calibrated, int8 I/O)": (Precision.INT8, calibration),
            "int8 dynamic-range": (Precision.INT8, None),
        }
        files, runners = {}, {}
        for variant, (precision, calib) in variants.items():
            dst = work / f"{path.stem}-{variant.split()[0]}-{'full' if calib else 'dyn'}.tflite"
            convert_savedmodel_to_tflite(
                saved, dst, precision=precision, calibration=calib, integer_io=calib is not None
            )
            files[variant] = dst
            runners[variant] = TFLiteRunner(dst, threads=args.threads)
        medians = time_runs(runners, held_out[0], args.rounds, args.seconds)
        out_name = keras_runner.outputs[0].name
        for variant, runner in runners.items():
            got = [runner.run(f)[out_name] for f in held_out]
            agree = agreement(got, want)
            size = files[variant].stat().st_size
            ratio = median_ratio(medians[variant], medians["fp32"])
            rows.append(
                f"| {label} | {variant} | {size:,} | {size / files['fp32'].stat().st_size:.2f} "
                f"| {statistics.median(medians[variant]):.3f} | {ratio:.2f} | {agree['cosine']:.5f} | {agree['top1']:.0%} |"
            )
    return rows


def conversion_table(models, work: Path, args: argparse.Namespace) -> list[str]:
    import keras
    import tensorflow as tf

    from services.converters.tensorflow_native import write_keras_savedmodel
    from services.exporters.tflite import convert_savedmodel_to_tflite
    from services.runners.tensorflow import KerasRunner, load_keras_model
    from services.runners.tflite import TFLiteRunner

    def kiln(path: Path, dst: Path) -> None:
        # What keras-to-savedmodel and export:tflite do, minus parity and benchmark.
        saved = dst.with_suffix(".sm")
        write_keras_savedmodel(load_keras_model(path), saved)
        convert_savedmodel_to_tflite(saved, dst)

    def direct(path: Path, dst: Path) -> None:
        model = keras.saving.load_model(str(path), compile=False)
        # from_keras_model exports the model with model.export(), which prints every captured variable.
        with contextlib.redirect_stdout(io.StringIO()):
            dst.write_bytes(tf.lite.TFLiteConverter.from_keras_model(model).convert())

    rows = [
        "| model | Kiln s (median) | direct s (median) | Kiln / direct (median of pairs) | Kiln vs Keras max abs "
        "| direct vs Keras max abs | Kiln vs direct max abs | cosine Kiln vs direct | sizes (Kiln / direct bytes) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    rng = np.random.default_rng(1)
    for label, path, shape in models:
        times: dict[str, list[float]] = {"kiln": [], "direct": []}
        for i in range(args.conversions):
            order = [("kiln", kiln), ("direct", direct)] if i % 2 == 0 else [("direct", direct), ("kiln", kiln)]
            for key, fn in order:
                dst = work / f"{path.stem}-{key}-{i}.tflite"
                t0 = time.perf_counter()
                fn(path, dst)
                times[key].append(time.perf_counter() - t0)
        keras_runner = KerasRunner(path)
        name, out = keras_runner.inputs[0].name, keras_runner.outputs[0].name
        feeds = [{name: rng.standard_normal((1, *shape)).astype(np.float32)} for _ in range(16)]
        want = [keras_runner.run(f)[out] for f in feeds]
        kiln_tfl = TFLiteRunner(work / f"{path.stem}-kiln-0.tflite")
        direct_tfl = TFLiteRunner(work / f"{path.stem}-direct-0.tflite")
        got_kiln = [kiln_tfl.run(f)[out] for f in feeds]
        got_direct = [next(iter(direct_tfl.run({direct_tfl.inputs[0].name: f[name]}).values())) for f in feeds]
        k_vs_keras = agreement(got_kiln, want)
        d_vs_keras = agreement(got_direct, want)
        k_vs_d = agreement(got_kiln, got_direct)
        ratio = median_ratio(times["kiln"], times["direct"])
        sizes = f"{(work / f'{path.stem}-kiln-0.tflite').stat().st_size:,} / {(work / f'{path.stem}-direct-0.tflite').stat().st_size:,}"
        rows.append(
            f"| {label} | {statistics.median(times['kiln']):.2f} | {statistics.median(times['direct']):.2f} | {ratio:.2f} "
            f"| {k_vs_keras['max_abs']:.1e} | {d_vs_keras['max_abs']:.1e} | {k_vs_d['max_abs']:.1e} | {k_vs_d['cosine']:.6f} | {sizes} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.5, help="timing per variant per round")
    parser.add_argument("--threads", type=int, default=1, help="LiteRT interpreter threads")
    parser.add_argument("--conversions", type=int, default=3, help="conversions per method per model")
    args = parser.parse_args()
    import tensorflow as tf

    with tempfile.TemporaryDirectory(prefix="kiln-bench-tflite-") as tmp:
        work = Path(tmp)
        models = build_models(work)
        load = os.getloadavg()
        print(
            f"TensorFlow {tf.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
            f"load average at start {load[0]:.1f}; LiteRT threads={args.threads}, rounds={args.rounds}, "
            f"conversions={args.conversions}\n"
        )
        print("### TFLite int8 against fp32 (latency ratio < 1 is faster)\n")
        print("\n".join(precision_table(models, work, args)))
        print("\n### Kiln's Keras → TFLite against a direct TFLiteConverter.from_keras_model call (fp32)\n")
        print("\n".join(conversion_table(models, work, args)))


if __name__ == "__main__":
    main()
