"""Measure onnxruntime static int8 on real pretrained models: each option that matters, and auto_exclude.

For each model (PyPI wheels, kiln_testing/real_models.py) and realistic inputs, the first
``--calib`` samples calibrate and the rest are held out. Each variant of
``options.onnxruntime.int8`` (services/exporters/ort_int8.py) is quantised from the source
model and checked on the held-out samples against the fp32 model on onnxruntime at Kiln's
default int8 bounds: worst output's worst-sample SNR and Pearson, pass or fail. Its p50 latency
is timed beside the fp32 model's, one thread each, run by run (kiln_testing/timing.py), batch 1.

Then the model is compiled by Kiln itself (services.pipeline.compile_model, default options:
auto_exclude on) with the same samples as calibration data: published or not, and why; where
that fails, again with ``calibrate_method: percentile`` (auto_exclude still on).

    python benchmarks/bench_ort_int8.py [--models a,b] [--calib 16] [--held-out 8] [--out r.json]

Results go to docs/benchmarks.md ("onnxruntime int8 options on real models").
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
from kiln_testing.timing import median_ratio, run_by_run
from services.descriptors.onnxruntime import OnnxRuntimeInt8Options
from services.exporters.ort_int8 import preprocess, quantize_int8
from services.pipeline import compile_model
from services.repository.local import LocalModelRepository
from services.spec import DEFAULT_TOLERANCES, Precision, load_spec
from services.storage import LocalArtifactStore
from services.validation import check_parity

DEFAULT_MODELS = (
    "ppocr-mobile-cls",
    "nudenet-320n",
    "magika-standard-v3.3",
    "minilm-l3-paraphrase",
    "ppocr-v4-rec",
    "ppocr-v4-det",
)
VARIANTS: dict[str, dict[str, Any]] = {
    "default (minmax, qdq, per-channel)": {},
    "entropy": {"calibrate_method": "entropy"},
    "percentile 99.999": {"calibrate_method": "percentile"},
    "symmetric activations": {"activation_symmetric": True},
    "per-tensor weights": {"per_channel": False},
    "qoperator": {"quant_format": "qoperator"},
}


class _Session:
    """One onnxruntime session on one thread, with a ``run(feeds)`` the timing helpers call."""

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.session.get_outputs()]
        self.inputs = {i.name for i in self.session.get_inputs()}

    def run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(
            zip(self.names, self.session.run(None, {k: v for k, v in feed.items() if k in self.inputs}), strict=True)
        )


def _verdict(actual: list[dict[str, np.ndarray]], expected: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    report = check_parity(
        actual, expected, DEFAULT_TOLERANCES[Precision.INT8], inputs_from="held out", raise_on_failure=False
    )
    return _worst(report.to_dict())


def _worst(parity: dict[str, Any]) -> dict[str, Any]:
    """Return the worst output's worst-sample SNR and Pearson of a parity report (float outputs only)."""
    outs = [o for o in parity["outputs"] if o.get("snr_db") is not None]
    worst = min(outs, key=lambda o: o["snr_db"]) if outs else {}
    return {
        "passed": parity["passed"],
        "output": worst.get("name"),
        "snr_db": worst.get("snr_db"),
        "pearson": min((o["pearson"] for o in outs if o.get("pearson") is not None), default=None),
        "failures": parity.get("failures", [])[:2],
    }


def _latency(int8: Path, fp32: Path, feed: dict[str, np.ndarray]) -> dict[str, float]:
    a, b = _Session(int8), _Session(fp32)
    ms = run_by_run([(a, feed), (b, feed)], rounds=3, seconds=1.0, warmup=2, min_cycles=5, clock=time.process_time)
    return {
        "p50_ms": round(float(np.median(ms[0])), 3),
        "fp32_p50_ms": round(float(np.median(ms[1])), 3),
        "ratio": round(median_ratio(ms[0], ms[1]), 2),
    }


def _spec_inputs(model: real_models.RealModel, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    out = {}
    for t in model.inputs:
        arr = feeds[t.name]
        if t.batch_axis != 0 or arr.ndim == 0:
            continue
        out[t.name] = {"shape": [-1 if model.max_batch != 1 else 1, *arr.shape[1:]]}
    return out


def measure(name: str, root: Path, n_calib: int, n_held: int) -> dict[str, Any]:
    """Return one model's variants (held-out verdict, latency) and Kiln's own compile of it."""
    model = real_models.get(name)
    src = real_models.fetch(model)
    stacked = real_models.realistic_inputs(model, src, n=n_calib + n_held, seed=11)
    samples = real_models.split_samples(model, stacked)
    calib, held = samples[:n_calib], samples[n_calib:]
    work = root / name
    work.mkdir(parents=True, exist_ok=True)
    fp32 = _Session(src)
    expected = [fp32.run(f) for f in held]
    pre = preprocess(src, work)
    rows: list[dict[str, Any]] = []
    for label, opts in VARIANTS.items():
        dst = work / f"{len(rows)}.onnx"
        started = time.perf_counter()
        try:
            settings = quantize_int8(src, dst, calib, work, OnnxRuntimeInt8Options(**opts), preprocessed=pre)
            row = {"variant": label, **_verdict([_Session(dst).run(f) for f in held], expected)}
            row.update(_latency(dst, src, held[0]))
            row["per_channel"] = settings["per_channel"]
        except Exception as exc:  # a variant onnxruntime cannot build or load is a result, not a crash
            row = {"variant": label, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        row["seconds"] = round(time.perf_counter() - started, 1)
        print(json.dumps({"model": name, **row}), flush=True)
        rows.append(row)
    rows.append(_kiln(name, model, src, stacked, work, {}))
    print(json.dumps({"model": name, **rows[-1]}, default=str), flush=True)
    if rows[-1]["status"] != "succeeded" and rows[-1]["auto_exclude"]["attempts"]:
        # What a user would try next: the calibration that did best above, with auto_exclude again.
        rows.append(_kiln(name, model, src, stacked, work, {"calibrate_method": "percentile"}))
        print(json.dumps({"model": name, **rows[-1]}, default=str), flush=True)
    return {"model": name, "rows": rows}


def _kiln(
    name: str, model: real_models.RealModel, src: Path, stacked: dict[str, np.ndarray], work: Path, int8: dict[str, Any]
) -> dict[str, Any]:
    """Compile ``src`` to onnxruntime int8 with Kiln's defaults (auto_exclude on) and ``int8``; return the verdict."""
    work = work / f"kiln-{len(int8)}"
    work.mkdir(exist_ok=True)
    calib = work / "calibration.npz"
    np.savez(calib, **stacked)
    spec = load_spec(
        {
            "targets": ["onnxruntime"],
            "precision": "int8",
            "name": name,
            "benchmark": False,
            "calibration": str(calib),
            "inputs": _spec_inputs(model, stacked),
            "options": {"onnxruntime": {"int8": int8}},
        }
    )
    started = time.perf_counter()
    repo = work / "repo"
    result = compile_model(src, spec, store=LocalArtifactStore(work / "store"), repository=LocalModelRepository(repo))
    t = result.targets["onnxruntime"]
    label = "kiln compile, auto_exclude" + "".join(f", {k} {v}" for k, v in int8.items())
    row: dict[str, Any] = {"variant": label, "status": t.status}
    details = (t.error or {}).get("details") or {}
    parity = t.parity or details.get("parity")
    if parity:
        row.update(_worst(parity))
    manifests = list(repo.glob("triton/*/1/kiln-manifest.json"))
    int8 = json.loads(manifests[0].read_text())["engine_details"]["int8"] if manifests else details.get("int8") or {}
    auto = int8.get("auto_exclude") or {}
    row["auto_exclude"] = {
        "attempts": [
            (a.get("tried", "-"), a["excluded"], a["worst_snr_db"], a["passed"]) for a in auto.get("attempts", [])
        ],
        "left_in_float": [e["node"] for e in auto.get("left_in_float", [])],
    }
    if t.status == "succeeded":
        published = manifests[0].parent / "model.onnx"
        feed = real_models.split_samples(model, stacked)[-1]
        row.update(_latency(published, src, feed))
    else:
        row["error"] = (t.error or {}).get("message", "")[:400]
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--calib", type=int, default=16)
    parser.add_argument("--held-out", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results.append(measure(name, Path(tmp), args.calib, args.held_out))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str))
    print(
        "\n| model | variant | worst-sample SNR dB | worst Pearson | default bounds | int8 p50 / fp32 p50 (1 thread) |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        for row in r["rows"]:
            print(f"| {r['model']} | {row['variant']} | " + " | ".join(_cells(row)) + " |")


def _cells(row: dict[str, Any]) -> list[str]:
    """Return a result row's table cells: SNR, Pearson, verdict (with what auto_exclude did), latency."""
    snr = f"{row['snr_db']:.1f}" if row.get("snr_db") is not None else "–"
    pearson = f"{row['pearson']:.3f}" if row.get("pearson") is not None else "–"
    if "snr_db" not in row and "error" in row:
        verdict = "error: " + row["error"].split("Status Message")[0][:90].replace("|", "/")
    else:
        verdict = "**pass**" if row.get("passed") else "fail"
    auto = row.get("auto_exclude")
    if auto:
        n = len(auto["left_in_float"])
        verdict += f"; {n} nodes left in float" if n else ("; none needed" if len(auto["attempts"]) == 1 else "")
        verdict += ", published" if row.get("status") == "succeeded" else ", not published"
    ratio = f"{row['ratio']:.2f} ({row['p50_ms']:.1f} / {row['fp32_p50_ms']:.1f} ms)" if "ratio" in row else "–"
    return [snr, pearson, verdict, ratio]


if __name__ == "__main__":
    main()
