"""int4 against int8 and fp32: artifact size, latency and parity of Kiln's onnxruntime and OpenVINO artifacts.

The model is a random-weight GPT-2 (transformers' GPT2LMHeadModel from a GPT2Config; by
default n_embd 256, 4 layers, 8 heads, vocabulary 8192, 64 tokens), exported to ONNX and
compiled by Kiln for both targets at fp32, int8 and int4 (``compile_model``, the library
entry the CLI and the workers call, so the artifacts are exactly what Kiln publishes).
Size is the artifact's files on disk; parity is Kiln's own report (cosine of the logits
against the source model). Latency: every artifact of a target runs through Kiln's runner
of that engine (same request path), the variants take turns run by run inside each of
``--rounds`` rounds so load from other processes hits them alike, and each ratio is taken
per round with its median (min-max) over rounds reported.

    .venv/bin/python benchmarks/bench_int4.py [--rounds 7] [--seconds 0.5] [--threads 1] [--seq 64]

``--seq 1`` measures one decoding step (memory-bound), the default 64 tokens a prompt.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from kiln_testing.timing import ratio_cell, run_by_run  # noqa: E402

PRECISIONS = ("fp32", "int8", "int4")
TARGETS = ("onnxruntime", "openvino")


@dataclass
class Variant:
    target: str
    precision: str
    artifact: Path
    cosine: float
    runner: Any = None
    rounds: list[float] = field(default_factory=list)

    @property
    def size(self) -> int:
        # Every file the artifact's version folder holds but the manifest: model.onnx (+ .data), model.xml + .bin.
        return sum(p.stat().st_size for p in self.artifact.parent.iterdir() if p.name != "kiln-manifest.json")


def compile_all(model: Path, tmp: Path) -> list[Variant]:
    from services.pipeline import compile_model
    from services.repository import LocalModelRepository
    from services.spec import load_spec
    from services.storage import LocalArtifactStore

    store = LocalArtifactStore(tmp / "store")  # conversions and the reference are shared across precisions
    variants = []
    for precision in PRECISIONS:
        spec = load_spec({"targets": list(TARGETS), "precision": precision, "name": "lm", "benchmark": False})
        result = compile_model(model, spec, store=store, repository=LocalModelRepository(tmp / f"repo-{precision}"))
        for target in TARGETS:
            t = result.targets[target]
            if t.status != "succeeded":
                raise SystemExit(f"kiln failed on {target} at {precision}: {t.error}")
            cosine = min(o["cosine"] for o in t.parity["outputs"])
            variants.append(Variant(target, precision, Path(t.artifact or ""), cosine))
    return variants


def attach_runners(variants: list[Variant], threads: int) -> None:
    from services.runners.onnx import OnnxRuntimeRunner
    from services.runners.openvino import OpenVINORunner

    for v in variants:
        if v.target == "onnxruntime":
            v.runner = OnnxRuntimeRunner(v.artifact, threads=threads)
        else:
            v.runner = OpenVINORunner(v.artifact, inference_precision="f32", threads=threads)


def interleave(variants: list[Variant], ids: np.ndarray, rounds: int, seconds: float) -> None:
    """Time the variants run by run, rotating who goes first; each round keeps each one's median (ms)."""
    # Keyed by each runner's own input name: a compiled OpenVINO model may list an alias
    # (another tensor name of the same port) before "input_ids".
    entries = [(v.runner, {v.runner.inputs[0].name: ids}) for v in variants]
    for v, medians in zip(variants, run_by_run(entries, rounds, seconds, min_cycles=10, rotate=True), strict=True):
        v.rounds.extend(medians)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.5, help="timed seconds per variant per round")
    ap.add_argument("--threads", type=int, default=1, help="inference threads of both engines")
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()

    import onnxruntime
    import openvino

    from kiln_testing import models

    models.GPT2_VOCAB = args.vocab
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        onnx_path = models.tiny_gpt2_onnx(
            tmp / "gpt2.onnx", n_embd=args.n_embd, n_layer=args.layers, n_head=args.heads, seq=args.seq
        )
        variants = compile_all(onnx_path, tmp)
        attach_runners(variants, args.threads)
        ids = np.random.default_rng(0).integers(0, args.vocab, (1, args.seq)).astype(np.int64)
        for target in TARGETS:
            interleave([v for v in variants if v.target == target], ids, args.rounds, args.seconds)

        print(
            f"GPT-2 (random weights): n_embd {args.n_embd}, {args.layers} layers, {args.heads} heads, "
            f"vocabulary {args.vocab}, batch 1 x {args.seq} tokens; {args.rounds} interleaved rounds, "
            f"{args.threads} thread(s); onnxruntime {onnxruntime.__version__}, OpenVINO {openvino.__version__}, "
            f"{platform.processor() or platform.machine()}"
        )
        print()
        print(
            "| target | precision | size MiB | size vs fp32 | p50 ms | latency vs fp32 | latency vs int8 | logits cosine |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for target in TARGETS:
            row = {v.precision: v for v in variants if v.target == target}
            for p in PRECISIONS:
                v = row[p]
                print(
                    f"| {target} | {p} | {v.size / 2**20:.2f} | {v.size / row['fp32'].size:.2f} | "
                    f"{statistics.median(v.rounds):.2f} | {ratio_cell(v.rounds, row['fp32'].rounds)} | "
                    f"{ratio_cell(v.rounds, row['int8'].rounds) if p == 'int4' else '-'} | {v.cosine:.4f} |"
                )


if __name__ == "__main__":
    main()
