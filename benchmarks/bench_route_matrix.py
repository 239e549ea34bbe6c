"""Architecture matrix: real architectures (random weights) x every CPU target; prints markdown.

Sources: keras.applications models built with ``weights=None`` at small input sizes (their
own layers: grouped convolutions and exact GELU in ConvNeXt, preprocessing Normalization
and Rescaling layers in EfficientNet and ConvNeXt), CNNs written here in torch and exported
to ONNX (a ResNet block, a ResNeXt block with a grouped 3x3, a ConvNeXt block with a
depthwise 7x7, LayerNorm and GELU), and a tiny ViT from transformers (a config, no download). Each goes
through one ``kiln compile`` job (in process) to onnxruntime, openvino, tflite and
tfserving at fp32, with parity against the source framework. A cell passes when the
target succeeded; the table says which route built it (1 = the first choice, 2+ = a
fallback) and names the error of a cell that failed.

    .venv/bin/python benchmarks/bench_route_matrix.py [--only NAME ...] [--targets T ...] [--out results.json]

Nothing is downloaded. Every model is built fresh in a temporary directory with a fresh
artifact store, so nothing comes from an earlier run's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

TARGETS = ["onnxruntime", "openvino", "tflite", "tfserving"]


# --------------------------------------------------------------------------- sources


def _keras_app(name: str, size: int) -> Callable[[Path], Path]:
    def build(dest: Path) -> Path:
        import keras

        keras.utils.set_random_seed(0)
        app = getattr(keras.applications, name)
        model = app(weights=None, input_shape=(size, size, 3), classes=10)
        path = dest / f"{name}.keras"
        model.save(path)
        return path

    return build


def _torch_blocks() -> dict[str, Any]:
    import torch
    from torch import nn

    class ResNetBlock(nn.Module):
        def __init__(self, c: int = 16) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, c, 3, padding=1)
            self.a, self.b = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
            self.bn_a, self.bn_b = nn.BatchNorm2d(c), nn.BatchNorm2d(c)
            self.head = nn.Linear(c, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.stem(x))
            x = torch.relu(x + self.bn_b(self.b(torch.relu(self.bn_a(self.a(x))))))
            return self.head(x.mean((2, 3)))

    class ResNeXtBlock(nn.Module):
        def __init__(self, c: int = 32, groups: int = 4) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, c, 3, padding=1)
            self.reduce = nn.Conv2d(c, c, 1)
            self.grouped = nn.Conv2d(c, c, 3, padding=1, groups=groups)
            self.expand = nn.Conv2d(c, c, 1)
            self.head = nn.Linear(c, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.stem(x))
            x = x + self.expand(torch.relu(self.grouped(torch.relu(self.reduce(x)))))
            return self.head(x.mean((2, 3)))

    class ConvNeXtBlock(nn.Module):
        def __init__(self, c: int = 32) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, c, 4, stride=4)
            self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
            self.norm = nn.LayerNorm(c)
            self.up, self.down = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
            self.gamma = nn.Parameter(torch.full((c,), 0.5))
            self.head = nn.Linear(c, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            y = self.dw(x).permute(0, 2, 3, 1)
            y = self.gamma * self.down(nn.functional.gelu(self.up(self.norm(y))))
            x = x + y.permute(0, 3, 1, 2)
            return self.head(x.mean((2, 3)))

    return {"ResNet block": ResNetBlock, "ResNeXt block (groups=4)": ResNeXtBlock, "ConvNeXt block": ConvNeXtBlock}


def _torch_onnx(label: str) -> Callable[[Path], Path]:
    def build(dest: Path) -> Path:
        import torch
        from models import export_onnx

        torch.manual_seed(0)
        module = _torch_blocks()[label]().eval()
        path = dest / (label.split()[0].lower() + ".onnx")
        return export_onnx(module, torch.randn(1, 3, 32, 32), path)

    return build


def _tiny_vit(dest: Path) -> Path:
    import torch
    from models import export_onnx
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
    )
    vit = ViTModel(config, add_pooling_layer=False).eval()

    class Features(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vit = vit

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return self.vit(pixel_values=pixel_values).last_hidden_state

    return export_onnx(Features().eval(), torch.randn(1, 3, 32, 32), dest / "vit.onnx", input_name="pixel_values")


SOURCES: dict[str, Callable[[Path], Path]] = {
    "keras MobileNetV3Small 64px": _keras_app("MobileNetV3Small", 64),
    "keras EfficientNetV2B0 64px": _keras_app("EfficientNetV2B0", 64),
    "keras ResNet50 64px": _keras_app("ResNet50", 64),
    "keras EfficientNetB0 64px": _keras_app("EfficientNetB0", 64),
    "keras DenseNet121 64px": _keras_app("DenseNet121", 64),
    "keras ConvNeXtTiny 64px": _keras_app("ConvNeXtTiny", 64),
    **{f"torch {label} (ONNX)": _torch_onnx(label) for label in _torch_blocks()},
    "transformers ViT tiny (ONNX)": _tiny_vit,
}


# --------------------------------------------------------------------------- running


def run_source(name: str, build: Callable[[Path], Path]) -> dict[str, Any]:
    """Compile one source for every CPU target; return per-target cells and the job's time."""
    from services.pipeline import compile_model
    from services.repository import LocalModelRepository
    from services.spec import load_spec
    from services.storage import LocalArtifactStore

    with tempfile.TemporaryDirectory(prefix="kiln-matrix-") as tmp:
        root = Path(tmp)
        try:
            src = build(root)
        except Exception as exc:  # a model this Keras/torch cannot build is reported, not fatal
            return {"source": name, "error": f"could not build: {type(exc).__name__}: {exc}"[:300], "cells": {}}
        spec = load_spec({"targets": TARGETS, "name": "m", "benchmark": False, "validation": {"samples": 4}})
        started = time.perf_counter()
        result = compile_model(
            src, spec, store=LocalArtifactStore(root / "store"), repository=LocalModelRepository(root / "repo")
        )
        seconds = time.perf_counter() - started
    cells = {}
    for target, t in result.targets.items():
        attempts = getattr(t, "attempts", None) or [{"rank": 1}]
        cell: dict[str, Any] = {"status": t.status, "rank": attempts[-1].get("rank", 1), "route": t.route}
        if t.status != "succeeded":
            err = t.error or {}
            cell["code"] = err.get("code")
            cell["message"] = (err.get("message") or "")[:240]
        else:
            cell["max_abs"] = max(float(o["max_abs"]) for o in t.parity["outputs"])
        cells[target] = cell
    return {"source": name, "seconds": round(seconds, 1), "cells": cells}


def markdown(rows: list[dict[str, Any]]) -> str:
    """Return the matrix as a markdown table, then the failed cells named with their errors."""
    lines = ["| source | " + " | ".join(TARGETS) + " | job s |", "|---|" + "---|" * (len(TARGETS) + 1)]
    passed = total = first = 0
    failures = []
    for row in rows:
        cells = []
        for target in TARGETS:
            cell = row["cells"].get(target)
            total += 1
            if cell is None:
                cells.append("not built")
                failures.append(f"- {row['source']} → {target}: {row.get('error')}")
            elif cell["status"] == "succeeded":
                passed += 1
                first += cell["rank"] == 1
                via = "" if cell["rank"] == 1 else f" (route {cell['rank']})"
                cells.append(f"ok{via}")
            else:
                cells.append(f"**{cell['code']}**")
                failures.append(f"- {row['source']} → {target}: `{cell['code']}` {cell['message']}")
        lines.append(f"| {row['source']} | " + " | ".join(cells) + f" | {row.get('seconds', '-')} |")
    lines.append("")
    lines.append(
        f"Passed {passed} of {total} cells ({first} on the first-choice route, {passed - first} by a fallback)."
    )
    if failures:
        lines += ["", "Failed cells:", *failures]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="substrings of source names to run")
    parser.add_argument("--out", type=Path, help="also write the raw results as JSON here")
    parser.add_argument("--targets", nargs="*", help=f"targets to compile for (default: {' '.join(TARGETS)})")
    args = parser.parse_args()
    if args.targets:
        TARGETS[:] = args.targets
    chosen = {k: v for k, v in SOURCES.items() if not args.only or any(s.lower() in k.lower() for s in args.only)}
    rows = []
    for name, build in chosen.items():
        print(f"... {name}", file=sys.stderr, flush=True)
        rows.append(run_source(name, build))
    import keras
    import onnx2tf
    import openvino
    import tensorflow as tf
    import tf2onnx
    import torch

    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"tf2onnx {tf2onnx.__version__}, onnx2tf {onnx2tf.__version__}, OpenVINO {openvino.__version__}, "
        f"torch {torch.__version__}\n"
    )
    print(markdown(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
