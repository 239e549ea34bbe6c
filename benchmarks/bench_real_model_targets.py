"""Per-target pass rate of real pretrained ONNX models, with concrete input shapes given (issue 19).

Each model from kiln_testing/real_models.py (PyPI wheels, fetched by pip, never committed) is
compiled by Kiln at fp32 for the chosen targets with 8 realistic samples as calibration data
and every input pinned to those samples' shapes at batch 1 (as a user passing
`--input x:1x3x480x640` would). Each cell is either published (Kiln's parity gate checked it
against the source) or refused with the error code and the first line of its message.

    python benchmarks/bench_real_model_targets.py [--targets tvm,tflite] [--precisions fp32,int8] [--models a,b] [--out cells.json]

onnxruntime and openvino artifacts are also checked here, independently of Kiln's parity code:
run with onnxruntime's and OpenVINO's own Python APIs on held-out samples against the source.

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

#: Targets whose published artifact this script runs itself, on its own runtime, against the source.
CHECKED_HERE = ("onnxruntime", "openvino")


def _independent_check(model: real_models.RealModel, path: Path, target: str, repo: Path) -> dict[str, Any]:
    """Run the published artifact with the engine's own Python API (not Kiln's runners or parity code) on
    held-out realistic samples, one at a time, and compare with the source run by onnxruntime.

    Returns the worst output's cosine and Pearson over the samples (outputs matched by name, else order).
    """
    import onnxruntime as ort

    held_out = real_models.split_samples(model, real_models.realistic_inputs(model, path, n=3, seed=99))
    source = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    if target == "onnxruntime":
        (artifact,) = repo.rglob("model.onnx")
        session = ort.InferenceSession(str(artifact), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]

        def run(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
            wanted = {i.name for i in session.get_inputs()}
            return list(session.run(None, {k: v for k, v in feed.items() if k in wanted}))
    else:
        import openvino as ov

        (xml,) = repo.rglob("model.xml")
        compiled = ov.Core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        names = [next(iter(o.get_names()), "") for o in compiled.outputs]

        def run(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
            result = compiled({p.get_any_name(): feed[p.get_any_name()] for p in compiled.inputs})
            return [np.asarray(result[o]) for o in compiled.outputs]

    ref_names = [o.name for o in source.get_outputs()]
    worst_cos, worst_r = 1.0, 1.0
    for feed in held_out:
        feed = {k: np.asarray(v) for k, v in feed.items()}
        ref = dict(zip(ref_names, source.run(None, feed), strict=True))
        got = run(feed)
        for i, value in enumerate(got):
            expected = ref.get(names[i]) if names[i] in ref else list(ref.values())[i]
            a, b = np.asarray(expected, np.float64).ravel(), np.asarray(value, np.float64).ravel()
            if a.size != b.size:
                return {"independent": f"output {names[i]}: {b.size} values, source {a.size}"}
            norm = np.linalg.norm(a) * np.linalg.norm(b)
            worst_cos = min(worst_cos, float(a @ b / norm) if norm else float(np.array_equal(a, b)))
            if a.std() > 0 and b.std() > 0:
                worst_r = min(worst_r, float(np.corrcoef(a, b)[0, 1]))
    return {"independent_cosine": round(worst_cos, 6), "independent_pearson": round(worst_r, 6)}


def _cell(model: real_models.RealModel, target: str, work: Path, precision: str = "fp32") -> dict[str, Any]:
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
            "precision": precision,
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
    cell: dict[str, Any] = {"model": model.name, "target": target, "precision": precision, "status": t.status}
    cell["seconds"] = round(time.perf_counter() - started, 1)
    if t.status == "succeeded" and target in CHECKED_HERE:
        try:
            cell.update(_independent_check(model, path, target, work / "repo"))
        except Exception as exc:  # the check's own failure is reported, not hidden
            cell["independent"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    if t.error:
        cell["code"] = t.error["code"]
        cell["message"] = t.error["message"].splitlines()[0][:160]
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="tvm")
    parser.add_argument("--models", default="")
    parser.add_argument("--precisions", default="fp32", help="e.g. fp32,int8 (each target at each)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    wanted = set(args.models.split(",")) if args.models else None
    models = [m for m in real_models.MODELS if m.format == "onnx" and (wanted is None or m.name in wanted)]
    cells = []
    for precision in args.precisions.split(","):
        for target in args.targets.split(","):
            for model in models:
                with tempfile.TemporaryDirectory() as tmp:
                    try:
                        cell = _cell(model, target, Path(tmp), precision)
                    except Exception as exc:  # a refusal before any step (e.g. INVALID_SPEC) is a cell too
                        cell = {"model": model.name, "target": target, "precision": precision}
                        cell.update(status="refused", message=str(exc)[:160])
                cells.append(cell)
                print(json.dumps(cell), flush=True)
    for precision in args.precisions.split(","):
        for target in args.targets.split(","):
            row = [c for c in cells if c["target"] == target and c["precision"] == precision]
            print(f"{target} {precision}: {sum(c['status'] == 'succeeded' for c in row)} of {len(row)} published")
    if args.out:
        args.out.write_text(json.dumps(cells, indent=2) + "\n")


if __name__ == "__main__":
    main()
