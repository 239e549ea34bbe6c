"""MNN against onnxruntime: latency ratios, parity and size of Kiln's mnn artifacts at fp32, fp16 and int8.

Models (random weights, built here or in kiln_testing/models.py, nothing downloaded): the tests'
tiny CNN (32x32) and transformer block (16 tokens x 32), a ResNet-18-like CNN and a
MobileNetV2-like CNN (depthwise-separable, inverted residuals) on 112x112 images, a
GPT-2-class LM (kiln_testing/models.py's, n_embd 256, 4 layers, 64 tokens) and a BERT-class encoder
(transformers' BertModel, hidden 256, 4 layers, 64 tokens; kiln_testing/transformer_models.py). Each is compiled by Kiln (``compile_model``, what the
CLI and the workers call) for onnxruntime at fp32 and for mnn at fp32, fp16 and int8, so the
artifacts are exactly what Kiln publishes. Every artifact runs through Kiln's runner of its
engine (same request path) with the same thread count; the variants take turns run by run
inside each of ``--rounds`` rounds so load from other processes hits them alike; each run
is timed in CPU time (see ``interleave``), and each ratio (MNN median / onnxruntime fp32
median; below 1 means MNN is faster) is taken per round and reported as its median (min-max)
over rounds.

    .venv/bin/python benchmarks/bench_mnn.py [--rounds 5] [--seconds 0.3] [--threads 1] [--batch 1]
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
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from kiln_testing.models import with_bn_statistics  # noqa: E402
from kiln_testing.timing import ratio_cell, run_by_run  # noqa: E402

MNN_PRECISIONS = ("fp32", "fp16", "int8")
Feeds = Callable[[int], dict[str, np.ndarray]]


@dataclass
class Variant:
    label: str
    artifact: Path
    cosine: float
    runner: Any = None
    rounds: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.artifact.parent.iterdir() if p.name != "kiln-manifest.json")


def _resnet_like() -> Any:
    import torch

    nn = torch.nn
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1 = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
            self.c2 = nn.Sequential(nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                if stride != 1 or cin != cout
                else nn.Identity()
            )

        def forward(self, x: Any) -> Any:
            return torch.relu(self.c2(self.c1(x)) + self.skip(x))

    layers: list[Any] = [nn.Conv2d(3, 32, 7, 2, 3, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 32
    for cout, stride in ((32, 1), (64, 2), (128, 2), (256, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 100))
    return _with_bn_statistics(model).eval()


def _mobilenet_like() -> Any:
    import torch

    nn = torch.nn
    torch.manual_seed(0)

    class Inverted(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int = 4) -> None:
            super().__init__()
            hidden = cin * expand
            self.body = nn.Sequential(
                nn.Conv2d(cin, hidden, 1, bias=False),
                nn.BatchNorm2d(hidden),
                nn.ReLU6(),
                nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                nn.BatchNorm2d(hidden),
                nn.ReLU6(),
                nn.Conv2d(hidden, cout, 1, bias=False),
                nn.BatchNorm2d(cout),
            )
            self.residual = stride == 1 and cin == cout

        def forward(self, x: Any) -> Any:
            y = self.body(x)
            return x + y if self.residual else y

    layers: list[Any] = [nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6()]
    cin = 16
    for cout, stride, n in ((24, 2, 2), (32, 2, 3), (64, 2, 3), (96, 1, 2), (160, 2, 2)):
        for i in range(n):
            layers.append(Inverted(cin, cout, stride if i == 0 else 1))
            cin = cout
    layers += [nn.Conv2d(cin, 640, 1, bias=False), nn.BatchNorm2d(640), nn.ReLU6()]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(640, 100))
    return _with_bn_statistics(model).eval()


def _with_bn_statistics(model: Any) -> Any:
    return with_bn_statistics(model, mean=(-0.2, 0.2), var=(0.5, 1.5), weight=(0.5, 1.0), bias=(-0.1, 0.1))


def _image(size: int) -> Feeds:
    return lambda b: {"input": np.random.default_rng(b).standard_normal((b, 3, size, size)).astype(np.float32)}


def build_models(tmp: Path, which: list[str]) -> list[tuple[str, Path, Feeds]]:
    import torch

    from kiln_testing import models as test_models

    out: list[tuple[str, Path, Feeds]] = []
    if "tiny-cnn" in which:
        out.append(("tests' tiny CNN, 32x32", test_models.tiny_cnn_onnx(tmp / "cnn.onnx"), _image(32)))
    if "block" in which:
        path = test_models.tiny_transformer_onnx(tmp / "block.onnx")
        feeds = lambda b: {"input": np.random.default_rng(b).standard_normal((b, 16, 32)).astype(np.float32)}  # noqa: E731
        out.append(("tests' transformer block, 16x32", path, feeds))
    if "resnet" in which:
        path = test_models.export_onnx(_resnet_like(), torch.randn(1, 3, 112, 112), tmp / "resnet.onnx")
        out.append(("ResNet-18-like, 112x112", path, _image(112)))
    if "mobilenet" in which:
        path = test_models.export_onnx(_mobilenet_like(), torch.randn(1, 3, 112, 112), tmp / "mobilenet.onnx")
        out.append(("MobileNetV2-like, 112x112", path, _image(112)))
    if "gpt2" in which:
        test_models.GPT2_VOCAB = 8192
        path = test_models.tiny_gpt2_onnx(tmp / "gpt2.onnx", n_embd=256, n_layer=4, n_head=8, seq=64)
        ids = lambda b: {"input_ids": np.random.default_rng(b).integers(0, 8192, (b, 64)).astype(np.int64)}  # noqa: E731
        out.append(("GPT-2-class (n_embd 256, 4 layers, vocab 8192), 64 tokens", path, ids))
    if "bert" in which:
        from kiln_testing.transformer_models import torch_transformer

        path, feeds = torch_transformer("bert", "torchscript", tmp / "bert.onnx")
        out.append(("BERT-class (hidden 256, 4 layers), 64 tokens", path, feeds))
    return out


def compile_variants(model: Path, tmp: Path) -> list[Variant]:
    from services.pipeline import compile_model
    from services.repository import LocalModelRepository
    from services.spec import load_spec
    from services.storage import LocalArtifactStore

    store = LocalArtifactStore(tmp / "store")  # the reference and the optimised ONNX are shared
    variants = []
    for target, precision in (("onnxruntime", "fp32"), *(("mnn", p) for p in MNN_PRECISIONS)):
        spec = load_spec({"targets": [target], "precision": precision, "name": "m", "benchmark": False})
        repo = LocalModelRepository(tmp / f"repo-{target}-{precision}")
        t = compile_model(model, spec, store=store, repository=repo).targets[target]
        if t.status != "succeeded":
            print(f"<!-- kiln failed on {target} {precision}: {t.error} -->")
            continue
        cosine = min(o["cosine"] for o in t.parity["outputs"])
        note = "weight-only" if any("weight-only" in w for w in t.warnings) else ""
        variants.append(Variant(f"{target} {precision}", Path(t.artifact or ""), cosine, note=note))
    return variants


def attach_runners(variants: list[Variant], model: Path, threads: int) -> None:
    from services.exporters.mnn import onnx_tensor_specs
    from services.runners.mnn import MnnRunner
    from services.runners.onnx import OnnxRuntimeRunner

    specs = onnx_tensor_specs(model)
    for v in variants:
        if v.label.startswith("onnxruntime"):
            v.runner = OnnxRuntimeRunner(v.artifact, threads=threads)
        else:
            precision = "low" if v.label.endswith("fp16") else "high"
            v.runner = MnnRunner(v.artifact, threads=threads, precision=precision, tensor_specs=specs)


def interleave(variants: list[Variant], feed: dict[str, np.ndarray], rounds: int, seconds: float) -> None:
    """Time the variants run by run, rotating who goes first; each round keeps each one's median CPU ms.

    CPU time (the process's, so helper threads count too), not wall time: on a machine shared
    with other jobs a run longer than the scheduler's slice is preempted and its wall time
    inflates (measured here under load 9 on 2 cores: onnxruntime, one thread, ResNet-like at
    batch 8, 9.9 ms of CPU in 30 ms of wall; at batch 1, 1.5 ms in 1.5 ms), which would
    favour whichever engine is faster. Both engines run one thread on the caller's thread.
    """
    entries = [(v.runner, feed) for v in variants]
    medians = run_by_run(entries, rounds, seconds, min_cycles=10, rotate=True, clock=time.process_time)
    for v, ms in zip(variants, medians, strict=True):
        v.rounds.extend(ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.3, help="timed seconds per variant per round")
    ap.add_argument("--threads", type=int, default=1, help="inference threads of both engines")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument(
        "--models",
        default="tiny-cnn,block,resnet,mobilenet,gpt2,bert",
        help="comma-separated: tiny-cnn,block,resnet,mobilenet,gpt2,bert",
    )
    args = ap.parse_args()

    from importlib import metadata

    print(
        f"<!-- {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
        f"mnn {metadata.version('mnn')}, onnxruntime {metadata.version('onnxruntime')}; threads {args.threads}, "
        f"batch {args.batch}, {args.rounds} rounds -->"
    )
    print(
        "| model | onnxruntime fp32 (CPU ms) | MNN fp32 / ORT | MNN fp16 / ORT | MNN int8 / ORT "
        "| cosine fp32 / fp16 / int8 | size ORT / MNN fp32 / fp16 / int8 |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for label, model, feeds in build_models(tmp, args.models.split(",")):
            work = tmp / model.stem
            work.mkdir()
            variants = compile_variants(model, work)
            attach_runners(variants, model, args.threads)
            interleave(variants, feeds(args.batch), args.rounds, args.seconds)
            by = {v.label: v for v in variants}
            ort = by["onnxruntime fp32"]
            cells = []
            for p in MNN_PRECISIONS:
                v = by.get(f"mnn {p}")
                cells.append(ratio_cell(v.rounds, ort.rounds) + (f" ({v.note})" if v.note else "") if v else "failed")
            cos = " / ".join(f"{by[f'mnn {p}'].cosine:.5f}" if f"mnn {p}" in by else "-" for p in MNN_PRECISIONS)
            sizes = " / ".join(
                f"{v.size / 1024:.0f} KiB" for v in [ort, *(by[f"mnn {p}"] for p in MNN_PRECISIONS if f"mnn {p}" in by)]
            )
            print(
                f"| {label} | {statistics.median(ort.rounds):.3f} ms | {cells[0]} | {cells[1]} | {cells[2]} "
                f"| {cos} | {sizes} |",
                flush=True,
            )
            for v in variants:
                v.runner.close()


if __name__ == "__main__":
    main()
