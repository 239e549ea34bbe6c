"""Modern-architecture matrix (issue 30): ten 2026 families x every engine, each artifact checked on its own runtime.

Each family of kiln_testing/modern_models.py (Llama-style GQA, Qwen3, Mistral with a sliding
window, Phi-3, Gemma-2, ModernBERT, DeBERTa-v2, DINOv2, Swin, T5 encoder; Llama and Qwen3 also
with past key values) is written as a Hugging Face checkpoint with tiny random weights and
compiled as a new user would: one ``kiln compile`` job (in process) to every engine at fp32,
``options.huggingface.task`` set, nothing pinned. Every published version is then loaded by
its engine's own runtime (kiln_testing/modern_matrix.py: not Kiln's runners, not Kiln's parity
code) and fed held-out inputs at each length it serves (12 and 20 tokens where the sequence
axis is open, with a padded tail for encoders), compared with the checkpoint run by transformers.

Each cell is named: ok (with the lengths served), wrong (published, disagrees: a bug),
engine limit or bug (``ENGINE_LIMITS`` / ``KNOWN_BUGS``; unexplained failures count as bugs).

    nice -n 10 .venv/bin/python benchmarks/bench_modern_matrix.py [--only KEY ...] [--targets T ...] [--out r.json]

Nothing is downloaded; every checkpoint is built fresh in a temporary folder with a fresh store.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from kiln_testing.modern_matrix import TARGETS, check_artifact, markdown, open_artifact, version_folder  # noqa: E402
from kiln_testing.modern_models import FAMILIES, Family, build_checkpoint  # noqa: E402


def run_family(fam: Family, targets: list[str]) -> dict[str, Any]:
    """Compile one family to ``targets`` in one job and check every published artifact; return its row."""
    from services.errors import KilnError
    from services.pipeline import compile_model
    from services.repository import LocalModelRepository
    from services.spec import load_spec
    from services.storage import LocalArtifactStore

    with tempfile.TemporaryDirectory(prefix="kiln-modern-") as tmp:
        root = Path(tmp)
        source = build_checkpoint(fam, root)
        spec = load_spec(
            {
                "targets": targets,
                "name": fam.key,
                "benchmark": False,
                "options": {"huggingface": {"task": fam.task}},
            }
        )
        started = time.perf_counter()
        try:
            result = compile_model(
                source, spec, store=LocalArtifactStore(root / "store"), repository=LocalModelRepository(root / "repo")
            )
        except KilnError as exc:  # refused before any target ran: every cell fails alike
            failed = {"status": "failed", "code": exc.code, "message": str(exc).splitlines()[0][:300]}
            return {
                "family": fam.key,
                "seconds": round(time.perf_counter() - started, 1),
                "cells": dict.fromkeys(targets, failed),
            }
        seconds = round(time.perf_counter() - started, 1)
        cells: dict[str, Any] = {}
        for target, outcome in result.targets.items():
            cell: dict[str, Any] = {"status": outcome.status, "route": outcome.route}
            if outcome.status != "succeeded":
                err = outcome.error or {}
                cell["code"] = err.get("code")
                cell["message"] = (err.get("message") or "").splitlines()[0][:300] if err.get("message") else ""
            else:
                try:
                    loaded = open_artifact(target, version_folder(root / "repo", target))
                    cell["settings"] = loaded.settings
                    cell["check"] = check_artifact(fam, source, loaded)
                except Exception as exc:  # the published files do not load on their own runtime: a finding
                    cell["check"] = {"ok": False, "problem": f"{type(exc).__name__}: {str(exc)[:300]}"}
            cells[target] = cell
            print(f"    {target}: {cell.get('check') or cell.get('code')}", file=sys.stderr, flush=True)
    return {"family": fam.key, "seconds": seconds, "cells": cells}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", nargs="*", help="family keys to run (default: all)")
    parser.add_argument("--targets", nargs="*", choices=TARGETS, help="engines (default: all seven)")
    parser.add_argument("--out", type=Path, help="also write the raw rows as JSON here, after every family")
    args = parser.parse_args()
    targets = list(args.targets or TARGETS)
    chosen = [f for f in FAMILIES if not args.only or f.key in args.only]
    rows = []
    for fam in chosen:
        print(f"... {fam.key} ({fam.task})", file=sys.stderr, flush=True)
        rows.append(run_family(fam, targets))
        if args.out:
            args.out.write_text(json.dumps({"targets": targets, "rows": rows}, indent=2))
    versions = []
    for dist in (
        "transformers",
        "torch",
        "onnxruntime",
        "openvino",
        "mnn",
        "pnnx",
        "ncnn",
        "apache-tvm",
        "onnx2tf",
        "tensorflow",
        "ai-edge-litert",
    ):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; " + ", ".join(versions) + "\n")
    print(markdown(rows, targets))


if __name__ == "__main__":
    main()
