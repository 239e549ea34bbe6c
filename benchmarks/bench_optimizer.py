"""Benchmark Kiln's ONNX optimiser against onnxslim and onnxruntime's basic offline optimisation.

For each model: node counts after each tool, each tool's own time, agreement with the
original model (worst |difference| on seeded inputs, relative to the output scale), and
onnxruntime latency of each variant as a ratio to the original model's (goal: Kiln <= both).

Latency is measured the way a served model runs: an onnxruntime session with its default
optimisation level (ORT_ENABLE_ALL) on each variant, ``--threads`` intra-op threads. Every
variant runs inside each round, the order alternating between rounds, for ``--rounds``
rounds; the ratio is taken per round and its median reported, so drift on a shared
machine hits all variants alike. With one thread onnxruntime runs the graph on the calling
thread, so the clock is that thread's CPU time: time spent waiting for a core that other
jobs hold is not counted (wall time otherwise).

    .venv/bin/python benchmarks/bench_optimizer.py [--rounds 7] [--seconds 0.3] [--threads 1] [--only NAME]
        [--keep-inferred-shapes]
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
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from kiln_testing.models import export_unfolded, resnetish_module  # noqa: E402
from kiln_testing.timing import in_blocks, ratio_cell  # noqa: E402

# --- models ----------------------------------------------------------------------------


def encoder_stack_module(layers: int = 4, d_model: int = 128, heads: int = 4) -> Any:
    """``layers`` transformer encoder blocks (the tests' block, wider)."""
    import torch

    from kiln_testing.models import tiny_transformer_module

    torch.manual_seed(0)
    return torch.nn.Sequential(*[tiny_transformer_module(d_model, heads) for _ in range(layers)]).eval()


def export_dynamo(module: Any, example: Any, path: Path) -> Path:
    """torch.export-based exporter (torch's default since 2.9) with its own optimisation off."""
    import torch

    program = torch.onnx.export(
        module, (example,), dynamo=True, optimize=False, dynamic_shapes=({0: torch.export.Dim("batch")},)
    )
    program.save(str(path))
    return path


def mobilenet_v2(path: Path) -> Path:
    """Keras MobileNetV2 (alpha 0.35, 96x96, random weights) converted by tf2onnx, as Kiln's keras route does."""
    import keras
    import onnx
    import tensorflow as tf
    import tf2onnx

    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(input_shape=(96, 96, 3), alpha=0.35, weights=None)
    spec = (tf.TensorSpec((None, 96, 96, 3), tf.float32, name="input"),)
    proto, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=17)
    onnx.save(proto, str(path))
    return path


Feeds = Callable[[int], dict[str, np.ndarray]]


def _float_input(shape: tuple[int, ...], name: str = "input") -> Feeds:
    """Seeded normal feeds for a model with one float input; the first axis is the batch."""

    def feeds(batch: int) -> dict[str, np.ndarray]:
        return {name: np.random.default_rng(batch).standard_normal((batch, *shape)).astype(np.float32)}

    return feeds


def _fixed(build: Callable[[], Path], shape: tuple[int, ...]) -> Callable[[], tuple[Path, Feeds]]:
    def built() -> tuple[Path, Feeds]:
        import onnx

        path = build()
        return path, _float_input(shape, onnx.load(str(path)).graph.input[0].name)

    return built


def build_models(tmp: Path) -> list[tuple[str, Callable[[], tuple[Path, Feeds]], tuple[int, ...]]]:
    """Return (label, builder, batches) per model; builders run lazily (``--only`` skips the rest)."""
    import torch

    from kiln_testing.models import export_onnx, tiny_cnn_onnx, tiny_transformer_onnx
    from kiln_testing.transformer_models import keras_transformer, torch_transformer

    models: list[tuple[str, Callable[[], tuple[Path, Feeds]], tuple[int, ...]]] = [
        ("tiny CNN (tests; exporter folded BN)", _fixed(lambda: tiny_cnn_onnx(tmp / "cnn.onnx"), (3, 32, 32)), (1,)),
        (
            "transformer block (tests; d=32, T=16)",
            _fixed(lambda: tiny_transformer_onnx(tmp / "tr.onnx"), (16, 32)),
            (1,),
        ),
        (
            "ResNet-ish, BN unfused (torch, no exporter folding; 64x64)",
            _fixed(
                lambda: export_unfolded(resnetish_module(), torch.randn(1, 3, 64, 64), tmp / "resnet.onnx"),
                (3, 64, 64),
            ),
            (1,),
        ),
        (
            "4-block encoder (torch dynamo exporter, optimize=False; d=128, T=64)",
            _fixed(
                lambda: export_dynamo(encoder_stack_module(), torch.randn(2, 64, 128), tmp / "enc_dyn.onnx"),
                (64, 128),
            ),
            (1,),
        ),
        (
            "4-block encoder (torch; d=128, T=64)",
            _fixed(lambda: export_onnx(encoder_stack_module(), torch.randn(1, 64, 128), tmp / "enc.onnx"), (64, 128)),
            (1,),
        ),
        (
            "MobileNetV2 0.35 (keras -> tf2onnx; 96x96)",
            _fixed(lambda: mobilenet_v2(tmp / "mnv2.onnx"), (96, 96, 3)),
            (1,),
        ),
    ]
    # Issue 12's transformer set: three architectures, three exporters, batch 1 and 8.
    names = {"bert": "BERT", "gpt2": "GPT-2", "vit": "ViT"}
    for kind, name in names.items():
        for exporter in ("torchscript", "dynamo"):
            models.append(
                (
                    f"{name} (transformers, torch {exporter})",
                    lambda k=kind, e=exporter: torch_transformer(k, e, tmp / f"{k}_{e}.onnx"),
                    (1, 8),
                )
            )
        models.append(
            (f"{name}-class Keras (tf2onnx)", lambda k=kind: keras_transformer(k, tmp / f"{k}_keras.onnx"), (1, 8))
        )
    return models


# --- the three optimisers ---------------------------------------------------------------


#: ``--keep-inferred-shapes``: Kiln's output as before issue 12's fix, for the before/after table.
KEEP_INFERRED_SHAPES = False


def run_kiln(model: Any, _path: Path, _tmp: Path) -> Any:
    from services.passes import optimize_model

    return optimize_model(model, keep_inferred_shapes=KEEP_INFERRED_SHAPES)[0]


def run_onnxslim(model: Any, _path: Path, _tmp: Path) -> Any:
    import onnxslim

    return onnxslim.slim(model)


def run_ort_basic(_model: Any, path: Path, tmp: Path) -> Any:
    """onnxruntime's basic (hardware-independent) level, written out with optimized_model_filepath."""
    import onnx
    import onnxruntime as ort

    out = tmp / f"{path.stem}.ort_basic.onnx"
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.optimized_model_filepath = str(out)
    opts.log_severity_level = 3
    ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return onnx.load(str(out))


TOOLS: dict[str, Callable[[Any, Path, Path], Any]] = {
    "Kiln": run_kiln,
    "onnxslim": run_onnxslim,
    "ORT basic": run_ort_basic,
}


# --- measuring --------------------------------------------------------------------------


@dataclass
class Variant:
    label: str
    model: Any
    nodes: int
    seconds: float = 0.0
    session: Any = None
    rounds: list[float] = field(default_factory=list)


def node_count(model: Any) -> tuple[int, int]:
    """Return (all nodes, nodes that are not Constant) of the main graph."""
    ops = [n.op_type for n in model.graph.node]
    return len(ops), sum(op != "Constant" for op in ops)


def session(model: Any, threads: int) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def worst_relative_diff(a: Any, b: Any, feeds: list[dict[str, np.ndarray]]) -> float:
    """Return max |a - b| / max |b| over outputs and feeds (sessions without ORT rewrites)."""
    from services.passes.verify import ort_session

    sa, sb = ort_session(a), ort_session(b)
    worst = 0.0
    for feed in feeds:
        for x, y in zip(sa.run(None, feed), sb.run(None, feed), strict=True):
            scale = float(np.max(np.abs(y))) or 1.0
            worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y))) / scale)
    return worst


def time_variants(
    variants: list[Variant], feed: dict[str, np.ndarray], rounds: int, seconds: float, clock: Any
) -> None:
    """Set each variant's ``rounds``: its median latency (ms, by ``clock``) per round, in blocks of ``seconds``."""
    calls = {i: partial(v.session.run, None, feed) for i, v in enumerate(variants)}
    ms = in_blocks(calls, rounds, seconds, warmup=2, clock=clock)
    for i, v in enumerate(variants):
        v.rounds = ms[i]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.3, help="timed seconds per variant per round")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    ap.add_argument("--only", help="substring of the model labels to run")
    ap.add_argument(
        "--keep-inferred-shapes",
        action="store_true",
        help="leave the shapes Kiln's passes inferred in its output (the behaviour before issue 12's fix)",
    )
    args = ap.parse_args()
    global KEEP_INFERRED_SHAPES
    KEEP_INFERRED_SHAPES = args.keep_inferred_shapes

    import onnx

    clock = time.thread_time if args.threads == 1 else time.perf_counter
    clock_name = "thread CPU time" if args.threads == 1 else "wall time"
    nodes_table = [
        "| model | original nodes | Kiln | onnxslim | ORT basic | optimiser time Kiln / onnxslim / ORT basic (ms) "
        "| worst rel. diff Kiln / onnxslim / ORT basic |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    latency_table = [
        f"| model | batch | original p50 ms ({clock_name}) | Kiln / original | onnxslim / original "
        f"| ORT basic / original | Kiln / onnxslim | Kiln / ORT basic |",
        "|---|---:|---:|---|---|---|---|---|",
    ]
    warmed = False
    with tempfile.TemporaryDirectory(prefix="kiln-bench-opt-") as tmpdir:
        tmp = Path(tmpdir)
        for label, build, batches in build_models(tmp):
            if args.only and args.only not in label:
                continue
            print(f"... {label}", file=sys.stderr)
            path, feeds = build()
            original = onnx.load(str(path))
            check_feeds = [feeds(b) for b in sorted({*batches, 2})]
            variants = [Variant("original", original, node_count(original)[0])]
            counts, times, diffs = [], [], []
            if not warmed:  # imports and one-off pattern compilation are not per-model costs
                for fn in TOOLS.values():
                    fn(original, path, tmp)
                warmed = True
            for tool, fn in TOOLS.items():
                started = time.perf_counter()
                optimised = fn(original, path, tmp)
                elapsed = time.perf_counter() - started
                total, real = node_count(optimised)
                variants.append(Variant(tool, optimised, total, elapsed))
                counts.append(f"{total} ({real})" if real != total else str(total))
                times.append(f"{elapsed * 1e3:.0f}")
                diffs.append(f"{worst_relative_diff(optimised, original, check_feeds):.1e}")
            total, real = node_count(original)
            nodes_table.append(
                f"| {label} | {total} ({real}) | "
                + " | ".join(counts)
                + f" | {' / '.join(times)} | {' / '.join(diffs)} |"
            )
            for v in variants:
                v.session = session(v.model, args.threads)
            for batch in batches:
                feed = feeds(batch)
                time_variants(variants, feed, args.rounds, args.seconds, clock)
                base, kiln, slim, ort_basic = variants
                pairs = ((kiln, base), (slim, base), (ort_basic, base), (kiln, slim), (kiln, ort_basic))
                cells = [ratio_cell(a.rounds, b.rounds, ".3f") for a, b in pairs]
                latency_table.append(
                    f"| {label} | {batch} | {statistics.median(base.rounds):.3f} | " + " | ".join(cells) + " |"
                )
                print(latency_table[-1], file=sys.stderr)
    print(f"Kiln ONNX optimiser benchmark — {time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPUs")
    print("\nNode counts (in parentheses: without Constant nodes), optimiser time, agreement with the original:\n")
    print("\n".join(nodes_table))
    print(
        "\nonnxruntime latency (session default ORT_ENABLE_ALL), ratios per round, median (min-max) over "
        f"{args.rounds} rounds, {args.threads} thread(s):\n"
    )
    print("\n".join(latency_table))


if __name__ == "__main__":
    main()
