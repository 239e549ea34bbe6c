"""Benchmark Kiln's PyTorch sources; prints markdown tables (see docs/benchmarks.md).

1. Loading a .pt2: Kiln's vetted loader (archive checks, JSON vetting, re-pack, then
   torch.export.load) against a bare ``torch.export.load`` of the same file: the price of
   not running code from the file. Ratio goal: small against what a compile costs anyway.
2. Converting to ONNX: Kiln's convert step (TorchScript exporter for .pt, dynamo exporter
   for .pt2), timed as the executor reports it, cold (first in the process) and warm.
3. Serving: the onnxruntime artifact at fp32/fp16/int8 against the source run in torch
   eager (the reference), same inputs, same request loop: latency ratio artifact/torch,
   plus the parity numbers Kiln recorded for each artifact.

Variants run interleaved for ``--rounds`` rounds (order reversed every other round) so
drift on a shared machine hits all alike; ratios are per round, median (min-max) shown.

    .venv/bin/python benchmarks/bench_torch_sources.py [--rounds 5] [--seconds 0.3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from kiln_testing.timing import in_blocks, ratio_cell  # noqa: E402


def build_sources(tmp: Path) -> list[dict[str, Any]]:
    """Return the benchmarked sources: label, path, a batch-1 feed, and the spec's inputs."""
    import torch
    from transformers import BertConfig, BertModel

    from kiln_testing.models import tiny_cnn_module

    cnn = tiny_cnn_module()
    x = torch.randn(2, 3, 32, 32)  # export specialises a size-1 axis, so examples use 2
    torch.jit.trace(cnn, x).save(str(tmp / "cnn.pt"))
    batch = torch.export.Dim("batch", min=1, max=64)
    torch.export.save(torch.export.export(cnn, (x,), dynamic_shapes={"x": {0: batch}}), str(tmp / "cnn.pt2"))

    torch.manual_seed(0)
    bert = BertModel(
        BertConfig(
            vocab_size=1000,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=128,
        )
    ).eval()
    ids = torch.randint(0, 1000, (2, 64))
    mask = torch.ones(2, 64, dtype=torch.int64)
    dims = {0: torch.export.Dim("b", min=1, max=32), 1: torch.export.Dim("s", min=2, max=128)}
    program = torch.export.export(
        bert,
        (),
        kwargs={"input_ids": ids, "attention_mask": mask},
        dynamic_shapes={"input_ids": dims, "attention_mask": dims},
    )
    torch.export.save(program, str(tmp / "bert.pt2"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.trace(bert, (ids, mask), strict=False).save(str(tmp / "bert.pt"))
    img = {"x": np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    seq = {"input_ids": ids[:1].numpy(), "attention_mask": mask[:1].numpy()}
    bert_inputs = {"input_ids": {"shape": [1, 64]}, "attention_mask": {"shape": [1, 64]}}
    return [
        {"label": "tiny CNN (tests) .pt", "path": tmp / "cnn.pt", "feed": img, "inputs": {}},
        {"label": "tiny CNN (tests) .pt2", "path": tmp / "cnn.pt2", "feed": img, "inputs": {}},
        {"label": "BERT d=128 L=4 T=64 .pt", "path": tmp / "bert.pt", "feed": seq, "inputs": bert_inputs},
        {"label": "BERT d=128 L=4 T=64 .pt2", "path": tmp / "bert.pt2", "feed": seq, "inputs": bert_inputs},
    ]


def load_table(sources: list[dict[str, Any]], rounds: int) -> list[str]:
    import torch

    from services.runners.torch_archives import load_exported_program

    rows = [
        "| source | torch.export.load ms | Kiln vetted load ms | ratio Kiln/torch (min-max) |",
        "|---|---:|---:|---:|",
    ]
    for src in sources:
        if src["path"].suffix != ".pt2":
            continue
        path = src["path"]
        load_exported_program(path)  # warm imports for both
        t = in_blocks(
            {"torch": lambda p=path: torch.export.load(str(p)), "kiln": lambda p=path: load_exported_program(p)},
            rounds,
            0.0,
            at_least=3,
        )
        rows.append(
            f"| {src['label']} | {statistics.median(t['torch']):.0f} | {statistics.median(t['kiln']):.0f} "
            f"| {ratio_cell(t['kiln'], t['torch'], '.3g', '.3g')} |"
        )
    return rows


def compile_sources(sources: list[dict[str, Any]], tmp: Path) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Compile each source to onnxruntime at every precision; return the convert-time table and artifacts."""
    from services.pipeline import compile_model
    from services.repository import LocalModelRepository
    from services.spec import load_spec
    from services.storage import LocalArtifactStore

    rows = ["| source | convert step | cold s (first in process) | warm s |", "|---|---|---:|---:|"]
    artifacts: dict[str, dict[str, Any]] = {}
    for src in sources:
        seconds: list[float] = []
        for precision in ("fp32", "fp16", "int8"):
            spec = load_spec(
                {
                    "targets": ["onnxruntime"],
                    "precision": precision,
                    "name": "m",
                    "benchmark": False,
                    "inputs": src["inputs"],
                }
            )
            events: list[dict[str, Any]] = []
            result = compile_model(
                src["path"],
                spec,
                store=LocalArtifactStore(tmp / "store"),
                repository=LocalModelRepository(tmp / f"repo-{precision}"),
                on_event=events.append,
                use_cache=False,
            )
            target = result.targets["onnxruntime"]
            if target.status != "succeeded":
                raise SystemExit(f"{src['label']} {precision}: {target.error}")
            step = next(s for s in result.plan.steps if s.kind == "convert")
            seconds += [e["seconds"] for e in events if e["type"] == "step_finished" and e["step"] == step.id]
            artifacts.setdefault(src["label"], {})[precision] = (Path(target.artifact or ""), target.parity)
        rows.append(f"| {src['label']} | {step.id} | {seconds[0]:.2f} | {statistics.median(seconds[1:]):.2f} |")
    return rows, artifacts


def serving_tables(
    sources: list[dict[str, Any]], artifacts: dict[str, dict[str, Any]], rounds: int, seconds: float, threads: int
) -> tuple[list[str], list[str]]:
    from services.formats import Format
    from services.runners import open_runner
    from services.spec import load_spec

    latency = [
        "| source | torch eager p50 ms | ORT fp32 ms | fp32/torch | ORT fp16 ms | fp16/torch | ORT int8 ms | int8/torch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    parity = ["| source | precision | worst max_abs | worst cosine | top-1 |", "|---|---|---:|---:|---:|"]
    for src in sources:
        fmt = Format.TORCH_EXPORT if src["path"].suffix == ".pt2" else Format.TORCHSCRIPT
        spec = load_spec({"targets": ["onnxruntime"], "inputs": src["inputs"]})
        torch_runner = open_runner(fmt, src["path"], inputs=spec.inputs)
        feed = src["feed"]
        variants = {"torch": lambda r=torch_runner, f=feed: r.run(f)}
        for precision, (path, report) in artifacts[src["label"]].items():
            ort = open_runner(Format.ONNX, path, threads=threads)
            variants[precision] = lambda r=ort, f=feed: r.run(f)
            outs = report["outputs"]
            top1 = [o["top1"] for o in outs if o.get("top1") is not None]
            parity.append(
                f"| {src['label']} | {precision} | {max(o['max_abs'] for o in outs):.2e} "
                f"| {min(o['cosine'] for o in outs):.6f} | {f'{min(top1):.0%}' if top1 else '-'} |"
            )
        t = in_blocks(variants, rounds, seconds)
        med = {k: statistics.median(v) for k, v in t.items()}
        latency.append(
            f"| {src['label']} | {med['torch']:.3f} "
            + " ".join(
                f"| {med[p]:.3f} | {ratio_cell(t[p], t['torch'], '.3g', '.3g')}" for p in ("fp32", "fp16", "int8")
            )
            + " |"
        )
    return latency, parity


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.3, help="timed seconds per variant per round")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for torch and onnxruntime alike")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)

    print(
        f"_{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, torch threads {torch.get_num_threads()}_\n"
    )
    with tempfile.TemporaryDirectory(prefix="kiln-bench-torch-") as tmpdir:
        tmp = Path(tmpdir)
        sources = build_sources(tmp)
        convert_rows, artifacts = compile_sources(sources, tmp)
        print("\n".join(load_table(sources, args.rounds)) + "\n")
        print("\n".join(convert_rows) + "\n")
        latency, parity = serving_tables(sources, artifacts, args.rounds, args.seconds, args.threads)
        print("\n".join(latency) + "\n")
        print("\n".join(parity))


if __name__ == "__main__":
    main()
