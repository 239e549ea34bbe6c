"""Benchmark Kiln's ncnn artifacts against onnxruntime on the same models; prints markdown tables.

Each model (random weights, built here or by kiln_testing/models.py) is exported to ONNX once and
compiled by Kiln (in process, parity against onnxruntime on the source included) to the
onnxruntime target at fp32 and to the ncnn target at fp32 and fp16. The published artifacts
are then timed through Kiln's own runners, as its benchmark step times them:
``OnnxRuntimeRunner`` (CPU provider, ``--threads`` intra-op threads) and ``NcnnRunner``
(``--threads`` ncnn threads; fp32 with fp16 storage off, fp16 with it on). Variants take turns
run by run inside each of ``--rounds`` rounds, so load from other processes hits all alike;
the ratio to onnxruntime is taken per round and its median reported.

Batch 8 on ncnn is eight single-sample inferences: ncnn blobs have no batch axis, so Kiln's
runner loops (services/runners/ncnn.py). The batch-8 ratio therefore shows what that costs
against onnxruntime's batched kernels.

    .venv/bin/python benchmarks/bench_ncnn.py [--rounds 7] [--seconds 0.4] [--threads 1] [--only NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kiln_testing.timing import median_ratio, run_by_run  # noqa: E402

BATCHES = (1, 8)


def _resnet_like() -> Any:
    """A ResNet-style CNN: stem, four stages of two residual blocks (32→256 channels), pooled head."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.a = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
            self.bn_a = nn.BatchNorm2d(cout)
            self.b = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
            self.bn_b = nn.BatchNorm2d(cout)
            self.skip = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
                if (cin, stride) != (cout, 1)
                else nn.Identity()
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.bn_b(self.b(torch.relu(self.bn_a(self.a(x)))))
            return torch.relu(y + self.skip(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU())
            layers, cin = [], 32
            for cout, stride in ((32, 1), (64, 2), (128, 2), (256, 2)):
                layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
                cin = cout
            self.body = nn.Sequential(*layers)
            self.head = nn.Linear(256, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(self.stem(x)).mean((2, 3)))

    from kiln_testing.models import with_bn_statistics

    torch.manual_seed(0)
    return with_bn_statistics(Net(), mean=(-0.2, 0.2)).eval()


def _encoder(layers: int, d_model: int, heads: int) -> Any:
    import torch

    from kiln_testing.models import tiny_transformer_module

    model = torch.nn.Sequential(*(tiny_transformer_module(d_model, heads) for _ in range(layers))).eval()
    # tiny_transformer_module seeds torch, so the blocks would be identical (and ONNX would store
    # their weights once): give each block its own weights.
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()
    return model


def _models() -> dict[str, tuple[Callable[[], Any], tuple[int, ...]]]:
    from kiln_testing.models import tiny_cnn_module, tiny_transformer_module

    return {
        "tests' CNN 3x32x32": (tiny_cnn_module, (3, 32, 32)),
        "tests' transformer block 16x32": (tiny_transformer_module, (16, 32)),
        "ResNet-like CNN 3x96x96 (16 convs)": (_resnet_like, (3, 96, 96)),
        "4-layer encoder d128 seq64": (lambda: _encoder(4, 128, 4), (64, 128)),
    }


def _compile(src: Path, targets: list[str], precision: str, store: Any, repo_dir: Path) -> dict[str, Any]:
    from services.pipeline import compile_model
    from services.repository import LocalModelRepository
    from services.spec import load_spec

    spec = load_spec({"targets": targets, "precision": precision, "name": "m", "benchmark": False})
    with contextlib.redirect_stderr(io.StringIO()):  # pnnx's output; the tables go to stdout
        result = compile_model(src, spec, store=store, repository=LocalModelRepository(repo_dir))
    out = {}
    for t in targets:
        target = result.targets[t]
        if target.status != "succeeded":
            raise SystemExit(f"{src.name} → {t} {precision} failed: {target.error}")
        version = Path(target.published["uri"].removeprefix("file://"))
        out[t] = (version, json.loads((version / "kiln-manifest.json").read_text()))
    return out


def _time(runners: dict[str, Any], feed: dict[str, np.ndarray], rounds: int, seconds: float) -> dict[str, list[float]]:
    """Return per-round median latency (ms) of each runner; runners alternate run by run."""
    medians = run_by_run([(r, feed) for r in runners.values()], rounds, seconds)
    return dict(zip(runners, medians, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", action="append", help="run only models whose label contains this")
    args = parser.parse_args()

    import onnxruntime
    import torch

    from kiln_testing.models import export_onnx
    from services.runners.ncnn import NcnnRunner
    from services.runners.onnx import OnnxRuntimeRunner
    from services.storage import LocalArtifactStore
    from services.versions import tool_versions

    started = time.monotonic()
    versions = tool_versions("ncnn")
    print(
        f"<!-- {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; onnxruntime "
        f"{onnxruntime.__version__}, ncnn {versions.get('ncnn')}, pnnx {versions.get('pnnx')}, "
        f"threads {args.threads}, rounds {args.rounds} x {args.seconds}s -->"
    )
    print()
    print(
        "| model | batch | onnxruntime fp32 p50 (ms) | ncnn fp32 p50 (ms) | ncnn fp32 / ort | ncnn fp16 p50 (ms) | ncnn fp16 / ort |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    facts = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-ncnn-") as tmp_name:
        tmp = Path(tmp_name)
        store = LocalArtifactStore(tmp / "store")
        for label, (factory, sample) in _models().items():
            if args.only and not any(o in label for o in args.only):
                continue
            src = export_onnx(factory(), torch.randn(1, *sample), tmp / f"m{len(facts)}.onnx")
            fp32 = _compile(src, ["onnxruntime", "ncnn"], "fp32", store, tmp / f"repo{len(facts)}-fp32")
            fp16 = _compile(src, ["ncnn"], "fp16", store, tmp / f"repo{len(facts)}-fp16")
            ort_dir, ncnn32_dir, ncnn16_dir = fp32["onnxruntime"][0], fp32["ncnn"][0], fp16["ncnn"][0]
            runners = {
                "ort": OnnxRuntimeRunner(ort_dir / "model.onnx", threads=args.threads),
                "ncnn32": NcnnRunner(ncnn32_dir / "model.ncnn.param", threads=args.threads),
                "ncnn16": NcnnRunner(ncnn16_dir / "model.ncnn.param", threads=args.threads),
            }
            name = runners["ort"].inputs[0].name
            for batch in BATCHES:
                feed = {name: np.random.default_rng(batch).standard_normal((batch, *sample)).astype(np.float32)}
                med = _time(runners, feed, args.rounds, args.seconds)
                r32 = median_ratio(med["ncnn32"], med["ort"])
                r16 = median_ratio(med["ncnn16"], med["ort"])
                p = {k: statistics.median(v) for k, v in med.items()}
                print(
                    f"| {label} | {batch} | {p['ort']:.3f} | {p['ncnn32']:.3f} | **{r32:.2f}** | "
                    f"{p['ncnn16']:.3f} | **{r16:.2f}** |",
                    flush=True,
                )
            for r in runners.values():
                r.close()
            facts.append(
                {
                    "model": label,
                    "fp32 parity": fp32["ncnn"][1]["parity"]["outputs"][0],
                    "fp16 parity": fp16["ncnn"][1]["parity"]["outputs"][0],
                    "ort bytes": (ort_dir / "model.onnx").stat().st_size,
                    "ncnn fp32 bytes": (ncnn32_dir / "model.ncnn.bin").stat().st_size,
                    "ncnn fp16 bytes": (ncnn16_dir / "model.ncnn.bin").stat().st_size,
                    "convert s": fp32["ncnn"][1]["engine_details"]["ncnn"]["convert_seconds"],
                }
            )
    print()
    print(
        "| model | ncnn fp32 max abs / cosine | ncnn fp16 max abs / cosine | model.onnx bytes | .bin fp32 | .bin fp16 | pnnx (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for f in facts:
        a, b = f["fp32 parity"], f["fp16 parity"]
        print(
            f"| {f['model']} | {a['max_abs']:.1e} / {a['cosine']:.6f} | {b['max_abs']:.1e} / {b['cosine']:.6f} | "
            f"{f['ort bytes']:,} | {f['ncnn fp32 bytes']:,} | {f['ncnn fp16 bytes']:,} | {f['convert s']:.2f} |"
        )
    print(f"\n<!-- wall time {time.monotonic() - started:.0f} s, load {os.getloadavg()[0]:.1f} -->")
    return 0


if __name__ == "__main__":
    sys.exit(main())
