"""Architecture matrix: real architectures (random weights) x every CPU target; prints markdown.

Sources: keras.applications models built with ``weights=None`` at small input sizes (their
own layers: grouped convolutions and exact GELU in ConvNeXt, preprocessing Normalization
and Rescaling layers in EfficientNet and ConvNeXt), CNNs written here in torch and exported
to ONNX (a ResNet block, a ResNeXt block with a grouped 3x3, a ConvNeXt block with a
depthwise 7x7, LayerNorm and GELU), a tiny ViT from transformers exported to ONNX, and
Hugging Face checkpoints (``config.json`` + safetensors written by ``save_pretrained`` from
tiny configs: BERT for sequence classification, GPT-2 causal LM in shards, ViT for image
classification, a T5 encoder), compiled with ``options.huggingface.task``.

The targets are read from the descriptor registry (services/descriptors): every registered
target whose engine runs on CPU and whose engine modules import here, so a target merged
later joins the matrix by itself; ``--targets`` picks some. Each source goes through one
``kiln compile`` job (in process) to every chosen target at fp32, with parity against the
source framework. A cell passes when the target succeeded; the table says which route built
it (1 = the first choice, 2+ = a fallback). A failed cell names its error code and a short
reason, and says whether it is a named limit (``KNOWN_LIMITS``), a diagnosed bug (``KNOWN_BUGS``;
both in kiln_testing/route_matrix.py) or unexplained (a bug until named); the summary gives the
pass rate per target and overall.

    .venv/bin/python benchmarks/bench_route_matrix.py [--only NAME ...] [--targets T ...] [--out results.json]

Nothing is downloaded. Every model is built fresh in a temporary directory with a fresh
artifact store, so nothing comes from an earlier run's cache.
"""

from __future__ import annotations

import argparse
import importlib
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
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from kiln_testing.route_matrix import markdown, short_reason, target_table  # noqa: E402

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

    class InvertedResidualSE(nn.Module):
        """MobileNetV3's block: expand 1x1, depthwise 3x3, squeeze-and-excitation, hardswish, project 1x1."""

        def __init__(self, c: int = 16, e: int = 64) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, c, 3, stride=2, padding=1)
            self.expand, self.dw = nn.Conv2d(c, e, 1), nn.Conv2d(e, e, 3, padding=1, groups=e)
            self.se_down, self.se_up = nn.Conv2d(e, e // 4, 1), nn.Conv2d(e // 4, e, 1)
            self.project, self.head = nn.Conv2d(e, c, 1), nn.Linear(c, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = nn.functional.hardswish(self.stem(x))
            y = nn.functional.relu6(self.dw(nn.functional.relu6(self.expand(x))))
            s = nn.functional.hardsigmoid(self.se_up(torch.relu(self.se_down(y.mean((2, 3), keepdim=True)))))
            x = x + self.project(y * s)
            return self.head(x.mean((2, 3)))

    class TinyUNet(nn.Module):
        """Encoder-decoder: strided conv down, max pool, transposed conv and bilinear resize up, skip concat."""

        def __init__(self, c: int = 8) -> None:
            super().__init__()
            self.enc1, self.enc2 = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, 2 * c, 3, padding=1)
            self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
            self.dec, self.out = nn.Conv2d(2 * c, c, 3, padding=1), nn.Conv2d(c, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = torch.relu(self.enc1(x))
            b = torch.relu(self.enc2(nn.functional.max_pool2d(a, 2)))
            y = self.out(torch.relu(self.dec(torch.cat([a, self.up(b)], 1))))
            return nn.functional.interpolate(y, scale_factor=0.5, mode="bilinear", align_corners=False)

    class RowLSTM(nn.Module):
        """An LSTM over the image's rows (sequence 32, features 3 x 32), last state to a classifier."""

        def __init__(self, hidden: int = 32) -> None:
            super().__init__()
            self.lstm = nn.LSTM(96, hidden, batch_first=True)
            self.head = nn.Linear(hidden, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seq = x.permute(0, 2, 1, 3).reshape(x.shape[0], 32, 96)
            out, _ = self.lstm(seq)
            return self.head(out[:, -1])

    return {
        "ResNet block": ResNetBlock,
        "ResNeXt block (groups=4)": ResNeXtBlock,
        "ConvNeXt block": ConvNeXtBlock,
        "MobileNetV3 block (SE, hardswish)": InvertedResidualSE,
        "UNet (ConvTranspose, resize)": TinyUNet,
        "LSTM over rows": RowLSTM,
    }


def _torch_onnx(label: str) -> Callable[[Path], Path]:
    def build(dest: Path) -> Path:
        import torch

        from kiln_testing.models import export_onnx

        torch.manual_seed(0)
        module = _torch_blocks()[label]().eval()
        path = dest / (label.split()[0].lower() + ".onnx")  # the first word is unique
        return export_onnx(module, torch.randn(1, 3, 32, 32), path)

    return build


def _tiny_vit(dest: Path) -> Path:
    import torch
    from transformers import ViTConfig, ViTModel

    from kiln_testing.models import export_onnx

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


HF_VOCAB = 64


def _hf_models(tf: Any) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Return family -> (model with random weights, save_pretrained extras)."""
    text = {"vocab_size": HF_VOCAB, "num_attention_heads": 2, "intermediate_size": 64}
    return {
        "bert": (
            tf.BertForSequenceClassification(
                tf.BertConfig(**text, hidden_size=32, num_hidden_layers=2, max_position_embeddings=64, num_labels=3)
            ),
            {},
        ),
        "distilbert": (
            tf.DistilBertForSequenceClassification(
                tf.DistilBertConfig(
                    vocab_size=HF_VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64
                )
            ),
            {},
        ),
        "gpt2": (
            tf.GPT2LMHeadModel(
                tf.GPT2Config(
                    vocab_size=HF_VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0
                )
            ),
            {"max_shard_size": "20KB"},  # config.json + model.safetensors.index.json + shards
        ),
        "gpt2-past": (
            tf.GPT2LMHeadModel(
                tf.GPT2Config(
                    vocab_size=HF_VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0
                )
            ),
            {},
        ),
        "llama": (
            tf.LlamaForCausalLM(
                tf.LlamaConfig(
                    **text,
                    hidden_size=32,
                    num_hidden_layers=2,
                    num_key_value_heads=1,  # grouped-query attention
                    max_position_embeddings=64,
                    bos_token_id=0,
                    eos_token_id=0,
                )
            ),
            {},
        ),
        "t5": (
            tf.T5EncoderModel(
                tf.T5Config(
                    vocab_size=HF_VOCAB,
                    d_model=32,
                    d_kv=16,
                    d_ff=64,
                    num_layers=2,
                    num_heads=2,
                    decoder_start_token_id=0,
                )
            ),
            {},
        ),
        "vit": (
            tf.ViTForImageClassification(
                tf.ViTConfig(
                    image_size=16,
                    patch_size=8,
                    num_channels=3,
                    hidden_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    intermediate_size=64,
                    num_labels=4,
                )
            ),
            {},
        ),
        "swin": (
            tf.SwinForImageClassification(
                tf.SwinConfig(
                    image_size=32,
                    patch_size=4,
                    embed_dim=16,
                    depths=[1, 1],
                    num_heads=[2, 2],
                    window_size=4,
                    num_labels=4,
                )
            ),
            {},
        ),
    }


#: Checkpoint family -> how the table names it.
HF_LABELS = {
    "bert": "BERT",
    "distilbert": "DistilBERT",
    "gpt2": "GPT-2 (sharded)",
    "gpt2-past": "GPT-2 with past key values",
    "llama": "Llama (GQA, RoPE)",
    "t5": "T5 encoder",
    "vit": "ViT",
    "swin": "Swin",
}


def _hf_checkpoint(family: str) -> Callable[[Path], Path]:
    """Return a builder of a tiny Hugging Face checkpoint directory (random weights, safetensors)."""

    def build(dest: Path) -> Path:
        import torch

        # Any: transformers' config stubs do not list the PretrainedConfig keywords (num_labels, ...).
        tf: Any = importlib.import_module("transformers")
        torch.manual_seed(0)
        model, extra = _hf_models(tf)[family]
        path = dest / family
        model.save_pretrained(str(path), safe_serialization=True, **extra)
        return path

    return build


#: options.huggingface.task per checkpoint (what the config's architectures imply, said explicitly).
HF_TASKS = {
    "bert": "sequence-classification",
    "distilbert": "sequence-classification",
    "gpt2": "causal-lm",
    "gpt2-past": "causal-lm-with-past",
    "llama": "causal-lm",
    "t5": "feature-extraction",
    "vit": "image-classification",
    "swin": "image-classification",
}

SOURCES: dict[str, Callable[[Path], Path]] = {
    "keras MobileNetV3Small 64px": _keras_app("MobileNetV3Small", 64),
    "keras MobileNetV2 64px": _keras_app("MobileNetV2", 64),
    "keras EfficientNetV2B0 64px": _keras_app("EfficientNetV2B0", 64),
    "keras ResNet50 64px": _keras_app("ResNet50", 64),
    "keras EfficientNetB0 64px": _keras_app("EfficientNetB0", 64),
    "keras DenseNet121 64px": _keras_app("DenseNet121", 64),
    "keras ConvNeXtTiny 64px": _keras_app("ConvNeXtTiny", 64),
    **{f"torch {label} (ONNX)": _torch_onnx(label) for label in _torch_blocks()},
    "transformers ViT tiny (ONNX)": _tiny_vit,
    **{f"HF checkpoint {HF_LABELS[f]}": _hf_checkpoint(f) for f in HF_TASKS},
}

#: Spec options per source (sources not named here take none).
SOURCE_OPTIONS: dict[str, dict[str, Any]] = {
    f"HF checkpoint {HF_LABELS[f]}": {"huggingface": {"task": task}} for f, task in HF_TASKS.items()
}


# --------------------------------------------------------------------------- running


def run_source(name: str, build: Callable[[Path], Path], targets: list[str]) -> dict[str, Any]:
    """Compile one source for the given targets; return per-target cells and the job's time."""
    from services.errors import KilnError
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
        body: dict[str, Any] = {"targets": targets, "name": "m", "benchmark": False, "validation": {"samples": 4}}
        if name in SOURCE_OPTIONS:
            body["options"] = SOURCE_OPTIONS[name]
        spec = load_spec(body)
        started = time.perf_counter()
        try:
            result = compile_model(
                src, spec, store=LocalArtifactStore(root / "store"), repository=LocalModelRepository(root / "repo")
            )
        except KilnError as exc:  # refused before any target ran (the source itself): every cell fails alike
            seconds = time.perf_counter() - started
            refused: dict[str, Any] = {
                "status": "failed",
                "code": exc.code,
                "message": short_reason(str(exc)),
                "detail": str(exc),
            }
            return {"source": name, "seconds": round(seconds, 1), "cells": dict.fromkeys(targets, refused)}
        seconds = time.perf_counter() - started
    cells = {}
    for target, t in result.targets.items():
        attempts = getattr(t, "attempts", None) or [{"rank": 1}]
        cell: dict[str, Any] = {"status": t.status, "rank": attempts[-1].get("rank", 1), "route": t.route}
        if t.status != "succeeded":
            err = t.error or {}
            cell["code"] = err.get("code")
            cell["message"] = short_reason(err.get("message") or "")
            cell["detail"] = err.get("message") or ""  # the whole message, for --out
        else:
            cell["max_abs"] = max(float(o["max_abs"]) for o in (t.parity or {}).get("outputs", [{"max_abs": 0}]))
        cells[target] = cell
    return {"source": name, "seconds": round(seconds, 1), "cells": cells}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", nargs="*", help="substrings of source names to run")
    parser.add_argument("--targets", nargs="*", help="targets to compile for (default: every runnable CPU target)")
    parser.add_argument("--out", type=Path, help="also write the raw results as JSON here")
    args = parser.parse_args()
    runnable, excluded = target_table()
    if args.targets:
        unknown = [t for t in args.targets if t not in runnable]
        if unknown:
            why = "; ".join(f"{t}: {excluded.get(t, 'not a registered target')}" for t in unknown)
            parser.error(f"cannot run {why} (runnable here: {', '.join(runnable)})")
        targets = [t for t in runnable if t in args.targets]
        excluded = {t: why for t, why in excluded.items() if t in args.targets}
    else:
        targets = runnable
    chosen = {k: v for k, v in SOURCES.items() if not args.only or any(s.lower() in k.lower() for s in args.only)}
    print(f"targets: {', '.join(targets)}", file=sys.stderr, flush=True)
    rows = []
    for name, build in chosen.items():
        print(f"... {name}", file=sys.stderr, flush=True)
        rows.append(run_source(name, build, targets))
        if args.out:  # written after every source, so a long run interrupted keeps what it measured
            args.out.write_text(json.dumps({"targets": targets, "excluded": excluded, "rows": rows}, indent=2))
    versions = []
    for dist in (
        "tensorflow",
        "keras",
        "tf2onnx",
        "onnx2tf",
        "openvino",
        "onnxruntime",
        "torch",
        "transformers",
        "mnn",
    ):
        try:
            from importlib import metadata

            versions.append(f"{dist} {metadata.version(dist)}")
        except Exception:  # not installed: say nothing about it
            continue
    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; " + ", ".join(versions) + "\n")
    print(markdown(rows, targets, excluded))


if __name__ == "__main__":
    main()
