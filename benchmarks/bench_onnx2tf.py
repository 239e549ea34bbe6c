"""The ONNX → SavedModel (onnx2tf) route per model; prints the markdown table in docs/benchmarks.md.

Each model is compiled by ``services.pipeline.compile_model`` (the call behind `kiln
compile`) for tflite and tfserving at fp32 in one job. Per model: onnx2tf's attempts
(dynamic shapes, then fixed ones when those fail) with their seconds, the input shapes the
SavedModel took, the convert step's and the whole job's seconds, and each target's parity
against the source model (worst max abs difference and cosine over its outputs, 4 samples).

Models, all with random weights built here: the tests' encoder block (ONNX, d=32, T=16,
dynamic batch); transformers' BertModel from a BertConfig as a torch.export ``.pt2`` with
dynamic batch and sequence: tiny (hidden 32, 2 layers, as in the tests) and, with
``--larger``, mini (hidden 256, 4 layers, 11 M parameters, sequence 128) and base-sized
(hidden 768, 12 layers, 109 M parameters, sequence 128); and the tiny BERT traced to TorchScript.

    .venv/bin/python benchmarks/bench_onnx2tf.py [--larger mini,base]

Times are single runs on a shared machine: orders of magnitude, not ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from kiln_testing.models import BERT_VOCAB, tiny_bert_module, tiny_transformer_onnx  # noqa: E402

CONVERT = "onnx-to-savedmodel"
LARGER = {
    "mini": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024},
    "base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
}


def bert_module(size: str) -> Any:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=30522, max_position_embeddings=512, **LARGER[size])).eval()


def export_pt2(module: Any, path: Path, seq: int, max_seq: int) -> Path:
    import torch

    ids = torch.randint(0, BERT_VOCAB, (2, seq))
    mask = torch.ones(2, seq, dtype=torch.int64)
    batch, length = torch.export.Dim("batch", min=1, max=32), torch.export.Dim("seq", min=2, max=max_seq)
    program = torch.export.export(
        module,
        (),
        kwargs={"input_ids": ids, "attention_mask": mask},
        dynamic_shapes={"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}},
    )
    torch.export.save(program, str(path))
    return path


def traced_pt(module: Any, path: Path, seq: int) -> Path:
    import torch

    ids = torch.randint(0, BERT_VOCAB, (1, seq))
    mask = torch.ones(1, seq, dtype=torch.int64)
    traced = torch.jit.trace(module, (ids, mask), strict=False)
    traced.save(str(path))
    return path


def run(label: str, model: Path, tmp: Path, shape: list[int] | None) -> str:
    from services.pipeline import compile_model
    from services.repository import LocalModelRepository
    from services.spec import load_spec
    from services.storage import LocalArtifactStore

    body: dict[str, Any] = {
        "targets": ["tflite", "tfserving"],
        "name": "m",
        "benchmark": False,
        "validation": {"samples": 4},
    }
    if shape:
        body["inputs"] = {"input_ids": {"shape": shape}, "attention_mask": {"shape": shape}}
    spec = load_spec(body)
    started = time.perf_counter()
    result = compile_model(
        model, spec, store=LocalArtifactStore(tmp / f"store-{label}"), repository=LocalModelRepository(tmp / "repo")
    )
    job_s = time.perf_counter() - started
    (step_id,) = [s for s in result.steps if s.endswith(CONVERT)]
    convert = result.steps[step_id]
    attempts = ", ".join(
        f"{a['input_shapes']} {'✗' if a.get('error') else '✓'} {a['seconds']:.1f}"
        for a in convert.meta.get("attempts", [])
    )
    fixed = convert.meta.get("fixed_input_shapes") or {}
    distinct = {str(v) for v in fixed.values()}
    shapes = "dynamic" if not fixed else (f"`{distinct.pop()}`" if len(distinct) == 1 else str(fixed))
    cells = []
    for target in ("tflite", "tfserving"):
        t = result.targets[target]
        if t.status != "succeeded" or not t.parity:
            cells.append(f"{t.status} ({(t.error or {}).get('code', '')})")
            continue
        outs = t.parity["outputs"]
        cells.append(f"{max(o['max_abs'] for o in outs):.1e} / {min(o['cosine'] for o in outs):.6f}")
    return f"| {label} | {attempts} | {shapes} | {convert.seconds:.1f} | {job_s:.1f} | {cells[0]} | {cells[1]} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--larger", default="", help="comma-separated: mini, base (minutes each)")
    args = ap.parse_args()

    import onnx2tf
    import tensorflow as tf

    rows = [
        "| model | onnx2tf attempts (s) | SavedModel input shapes | convert step s | job s "
        "| tflite max abs / cosine | tfserving max abs / cosine |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="kiln-bench-onnx2tf-") as tmpdir:
        tmp = Path(tmpdir)
        models: list[tuple[str, Path, list[int] | None]] = [
            ("encoder block (ONNX)", tiny_transformer_onnx(tmp / "block.onnx"), None),
            ("tiny BERT `.pt2`", export_pt2(tiny_bert_module(), tmp / "tiny.pt2", 16, 64), None),
            ("tiny BERT traced `.pt`", traced_pt(tiny_bert_module(), tmp / "tiny.pt", 16), None),
        ]
        for size in filter(None, args.larger.split(",")):
            models.append(
                (f"{size} BERT `.pt2`", export_pt2(bert_module(size), tmp / f"{size}.pt2", 128, 512), [1, 128])
            )
        for label, path, shape in models:
            print(f"... {label}", file=sys.stderr)
            rows.append(run(label, path, tmp, shape))
    print(
        f"onnx2tf {onnx2tf.__version__}, TensorFlow {tf.__version__}, Python {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}\n"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
