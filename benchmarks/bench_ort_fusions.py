"""Benchmark the onnxruntime-only fusions (services/passes/ort_fusions.py) against onnxslim, one step at a time.

Issue 11 item 5: Kiln's onnxruntime artifact <= 0.9x onnxslim's latency on BERT-, GPT-2- and
ViT-class models at batch 1 and 8, nodes <= onnxslim's, no change on CNNs. Per model, the
variants (each built from the one before, so each row says what one step does):

- ``original``: the exported model; ``onnxslim``: ``onnxslim.slim(original)``
- ``Kiln``: the optimize step (``optimize_model``), what the export started from before
- ``+ no value_info``: Kiln with every intermediate shape dropped (when an Add feeds a
  LayerNormalization), so that onnxruntime does not fuse SkipLayerNormalization at load
- ``+ attention``: onnxscript's sdpa, mha, mha_scale, mha_bias, attention and sdpa_via_mha fusions
- ``+ gelu``: its gelu and bias_gelu fusions: the artifact ``fuse_for_onnxruntime`` writes
  (untimed here; the export step also times it and keeps the faster)
- ``+ SkipLayerNorm``: onnxscript's skip_layer_normalization on top (left out of Kiln)
- ``optimize_for_ort``: onnxscript's whole ``optimize_for_ort`` on Kiln's output, as shipped

Latency as in bench_optimizer.py: onnxruntime sessions at ORT_ENABLE_ALL, one intra-op
thread, thread CPU time, all variants in every round in alternating order, ratio to
onnxslim per round, median (min-max) over rounds.

    .venv/bin/python benchmarks/bench_ort_fusions.py [--rounds 7] [--seconds 0.2] [--only NAME]
        [--cache DIR] [--biases zero|random]
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from bench_optimizer import Variant, node_count, session, time_variants  # noqa: E402

from kiln_testing.models import export_unfolded, resnetish_module  # noqa: E402
from kiln_testing.timing import ratio_cell  # noqa: E402

CONTRIB = ("Attention", "MultiHeadAttention", "BiasGelu", "Gelu", "FastGelu", "SkipLayerNormalization")


def _models(cache: Path, biases: str) -> list[tuple[str, Callable[[], tuple[Path, Any]], tuple[int, ...]]]:
    import numpy as np

    from kiln_testing.models import tiny_cnn_onnx
    from kiln_testing.transformer_models import keras_transformer, torch_transformer

    def cnn_feeds(shape: tuple[int, ...]) -> Any:
        return lambda b: {"input": np.random.default_rng(b).standard_normal((b, *shape)).astype(np.float32)}

    def cached(name: str, build: Callable[[Path], Any], feeds: Any) -> Callable[[], tuple[Path, Any]]:
        def built() -> tuple[Path, Any]:
            path = cache / f"{name}.onnx"
            if not path.exists():
                build(path)
            return path, feeds

        return built

    models: list[tuple[str, Callable[[], tuple[Path, Any]], tuple[int, ...]]] = [
        ("tiny CNN (tests)", cached("cnn", tiny_cnn_onnx, cnn_feeds((3, 32, 32))), (1, 8)),
        (
            "ResNet-ish, BN unfused (torch)",
            cached(
                "resnet",
                lambda p: export_unfolded(resnetish_module(), __import__("torch").randn(1, 3, 64, 64), p),
                cnn_feeds((3, 64, 64)),
            ),
            (1, 8),
        ),
    ]
    names = {"bert": "BERT", "gpt2": "GPT-2", "vit": "ViT"}
    suffix = "" if biases == "zero" else ", random biases"
    for kind, name in names.items():
        for exporter in ("torchscript", "dynamo"):
            models.append(
                (
                    f"{name} (transformers, torch {exporter}{suffix})",
                    lambda k=kind, e=exporter: torch_transformer(
                        k, e, cache / f"{k}_{e}_{biases}.onnx", random_biases=biases == "random", reuse=True
                    ),
                    (1, 8),
                )
            )
        models.append(
            (
                f"{name}-class Keras (tf2onnx)",
                lambda k=kind: keras_transformer(k, cache / f"{k}_keras.onnx", reuse=True),
                (1, 8),
            )
        )
    return models


def _variants(original: Any) -> list[tuple[str, Any, str]]:
    """Return (label, model, fusions that fired) per variant."""
    import onnx
    import onnx_ir as ir
    import onnxslim
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    from services.passes import optimize_model
    from services.passes.ort_fusions import apply_fusions, drop_value_info, has_skip_layernorm_pattern

    def copy(m: Any) -> Any:
        c = onnx.ModelProto()
        c.CopyFrom(m)
        return c

    out: list[tuple[str, Any, str]] = [("original", original, ""), ("onnxslim", onnxslim.slim(copy(original)), "")]
    kiln = optimize_model(original)[0]
    out.append(("Kiln", kiln, ""))
    drop = has_skip_layernorm_pattern(kiln)
    novi = copy(kiln)
    if drop:
        drop_value_info(novi)
    out.append(("+ no value_info", novi, f"{len(kiln.graph.value_info)} dropped" if drop else "no Add→LN"))
    attention = ("sdpa", "mha", "mha_scale", "mha_bias", "attention", "sdpa_via_mha")
    steps = [
        ("+ attention", attention),
        ("+ gelu", (*attention, "gelu", "bias_gelu")),
        ("+ SkipLayerNorm", (*attention, "gelu", "bias_gelu", "skip_layer_normalization")),
    ]
    for label, names in steps:
        try:
            fused, counts = apply_fusions(kiln, names)
        except Exception as exc:
            print(f"   {label}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        fused = copy(fused)
        if drop:
            drop_value_info(fused)
        out.append((label, fused, ", ".join(f"{k} {v}" for k, v in counts.items() if v)))
    try:
        model, counts = optimize_for_ort(ir.serde.deserialize_model(kiln))
        out.append(
            ("optimize_for_ort", ir.serde.serialize_model(model), ", ".join(f"{k} {v}" for k, v in counts.items() if v))
        )
    except Exception as exc:
        print(f"   optimize_for_ort: {type(exc).__name__}: {exc}", file=sys.stderr)
    return out


def _rel_diff(model: Any, reference: Any, feeds: list[dict[str, Any]]) -> str:
    import numpy as np

    from services.passes.verify import ort_session

    try:
        a, b = ort_session(model), ort_session(reference)
    except Exception as exc:
        return f"does not load ({type(exc).__name__})"
    worst = 0.0
    for feed in feeds:
        try:
            got = a.run(None, feed)
            # ...and as served: some rewrites load but fail only after onnxruntime's own fusions.
            session(model, 1).run(None, feed)
        except Exception as exc:
            return f"does not run (load {type(exc).__name__})"
        for x, y in zip(got, b.run(None, feed), strict=True):
            worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y))) / (float(np.max(np.abs(y))) or 1.0))
    return f"{worst:.1e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.2, help="timed seconds per variant per round")
    ap.add_argument("--only", help="substrings of the model labels to run, separated by ;")
    ap.add_argument("--cache", help="keep the exported models here between runs")
    ap.add_argument("--biases", choices=("zero", "random"), default="zero", help="torch models' biases")
    args = ap.parse_args()

    import onnx

    nodes_table = [
        "| model | variant | nodes (non-Constant) | contrib ops in the file | fusions fired | worst rel. diff |",
        "|---|---|---:|---|---|---|",
    ]
    lat_table = ["| model | batch | variant | p50 ms | / onnxslim (min-max) |", "|---|---:|---|---:|---|"]
    with tempfile.TemporaryDirectory(prefix="kiln-bench-fusion-") as tmpdir:
        cache = Path(args.cache) if args.cache else Path(tmpdir)
        cache.mkdir(parents=True, exist_ok=True)
        for label, build, batches in _models(cache, args.biases):
            if args.only and not any(part in label for part in args.only.split(";")):
                continue
            print(f"... {label}", file=sys.stderr)
            path, feeds = build()
            original = onnx.load(str(path))
            variants = []
            for name, model, fired in _variants(original):
                total, real = node_count(model)
                ops = collections.Counter(n.op_type for n in model.graph.node)
                contrib = ", ".join(f"{op} {ops[op]}" for op in CONTRIB if ops[op])
                diff = _rel_diff(model, original, [feeds(1), feeds(2)])
                nodes_table.append(f"| {label} | {name} | {total} ({real}) | {contrib} | {fired} | {diff} |")
                print(nodes_table[-1], file=sys.stderr)
                if diff.startswith("does not"):
                    continue
                variants.append(Variant(name, model, total))
            for v in variants:
                v.session = session(v.model, 1)
            slim = next(v for v in variants if v.label == "onnxslim")
            for batch in batches:
                feed = feeds(batch)
                time_variants(variants, feed, args.rounds, args.seconds, time.thread_time)
                for v in variants:
                    lat_table.append(
                        f"| {label} | {batch} | {v.label} | {statistics.median(v.rounds):.3f} "
                        f"| {ratio_cell(v.rounds, slim.rounds, '.3f')} |"
                    )
                    print(lat_table[-1], file=sys.stderr)
    print(
        f"Kiln onnxruntime fusions benchmark — {time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPUs"
    )
    print(f"biases: {args.biases}; {args.rounds} rounds of {args.seconds} s per variant, 1 thread, thread CPU time\n")
    print("\n".join(nodes_table))
    print()
    print("\n".join(lat_table))


if __name__ == "__main__":
    main()
