"""Benchmark `kiln tune`; prints markdown tables (see docs/benchmarks.md, "kiln tune").

For each model: a cold-cache search (latency objective, batch 1, onnxruntime × openvino ×
tflite, fp32/fp16/int8, each engine's settings grid), its wall time and cache reuse; then a
*separate* side-by-side re-timing of every passing candidate plus the default fp32
onnxruntime artifact (ORT's own defaults: no thread or optimisation setting), with more rounds,
to check that the recommendation is the fastest or within the measured noise of it, and the
ratio of its p50 to the default artifact's (median of the per-round ratios).

With ``--objective throughput`` (issue 21, item 5): a search at ``--batch`` sizes, whose
recommendation is measured at every batch × 1, 2, 4, 8 concurrent instances; the curve, the
pick (batch × instances) and its throughput over the best of the sweep; then a *separate*
sweep of the same points, to check that the pick is still within 10% of the best there.

    .venv/bin/python benchmarks/bench_tune.py [--rounds 60] [--recheck-rounds 200] [--only cnn]
    .venv/bin/python benchmarks/bench_tune.py --objective throughput --batch 1,8,32 [--sweep-rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from copy import deepcopy
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def build_models(tmp: Path) -> list[tuple[str, Path, dict[str, Any]]]:
    """Return (label, model path, the spec fields its builds share) for each model searched."""
    import torch

    from kiln_testing import real_models
    from kiln_testing.models import export_onnx, medium_cnn_module, tiny_transformer_module

    # A real detector (YOLOv8n, from the nudenet wheel, fetched by pip; never committed), at its
    # 320 x 320 input, calibrated and checked on realistic images.
    detector = real_models.get("nudenet-320n")
    det_path = real_models.fetch(detector)
    samples = tmp / "detector-samples.npz"
    np.savez(samples, **real_models.realistic_inputs(detector, det_path, n=8, seed=7))
    det_spec = {"inputs": {"images": {"shape": [1, 3, 320, 320]}}, "calibration": str(samples)}
    return [
        ("cnn", export_onnx(medium_cnn_module(), torch.randn(1, 3, 64, 64), tmp / "cnn_m.onnx"), {}),
        (
            "transformer",
            export_onnx(tiny_transformer_module(128, 4), torch.randn(1, 64, 128), tmp / "tr_m.onnx"),
            {},
        ),
        ("detector (YOLOv8n, nudenet 320n)", det_path, det_spec),
    ]


def recheck(report: Any, rounds: int, spec_data: dict[str, Any]) -> dict[str, Any]:
    """Re-time every passing candidate and the default fp32 onnxruntime artifact side by side, in a new run."""
    from services.spec import load_spec
    from services.tune.budget import Deadline
    from services.tune.measure import measure_candidates
    from services.tune.recommend import paired_difference
    from services.tune.report import Candidate

    rec_id = report.recommendation["id"]
    again = []
    for c in report.candidates:
        if c.passed:
            fresh = deepcopy(c)
            fresh.times, fresh.status, fresh.passed = [], "timed", False
            again.append(fresh)
    ort32 = next(b for b in report.built if b.target == "onnxruntime" and b.precision == "fp32")
    default = Candidate("onnxruntime", "fp32", {}, 1, passed=False, status="timed", artifact=ort32.artifact)
    again.append(default)
    formats = {b.target: b.artifact_format for b in report.built if b.artifact_format}
    spec = load_spec({**spec_data, "targets": ["onnxruntime"]})
    measure_candidates(again, formats, spec, rounds=rounds, warmup=10, deadline=Deadline(None))
    by_id = {c.key: c for c in again}
    rec = next(c for c in again if c.key == rec_id)
    timed = [c for c in again if c.passed and c is not default]
    fastest = min(timed, key=lambda c: c.p50_ms or 0.0)
    diff = paired_difference(rec, fastest) if fastest is not rec else None
    ratios = np.asarray(rec.times) / np.asarray(default.times)
    return {
        "rec": rec,
        "fastest": fastest,
        "rec_is_fastest": fastest is rec,
        "within_noise": fastest is rec or (diff is not None and diff["ci_ms"][1] >= 0 >= diff["ci_ms"][0]),
        "diff": diff,
        "default": default,
        "ratio_vs_default": float(np.median(ratios)),
        "rank": sorted(timed, key=lambda c: c.p50_ms or 0.0).index(rec) + 1,
        "timed": len(timed),
        "by_id": by_id,
    }


def print_curve(curve: dict[str, Any]) -> None:
    """Print a curve as a markdown table: samples/s (median, 95% interval) per batch × instances, the pick in bold."""
    levels = curve["concurrency"]
    print("| batch | " + " | ".join(f"{n} instance{'s' if n > 1 else ''}" for n in levels) + " |")
    print("|---:|" + "---:|" * len(levels))
    pick = curve["pick"] or {}
    for b in curve["batches"]:
        cells = []
        for n in levels:
            p = next(p for p in curve["points"] if p["batch"] == b and p["instances"] == n)
            if p["throughput"] is None:
                cells.append("-")
                continue
            lo, hi = p["throughput_ci"]
            cell = f"{p['throughput']:.0f} [{lo:.0f}–{hi:.0f}]"
            cells.append(f"**{cell}**" if (b, n) == (pick.get("batch"), pick.get("instances")) else cell)
        print(f"| {b} | " + " | ".join(cells) + " |")


def throughput_run(label: str, path: Path, store: Any, args: argparse.Namespace, spec_data: dict[str, Any]) -> None:
    """Search for throughput, print the curve and the pick, then re-sweep the same points separately."""
    from services.spec import load_spec
    from services.tune import TuneRequest, tune_model
    from services.tune.budget import Deadline
    from services.tune.concurrency import measure_concurrency

    batches = [int(b) for b in args.batch.split(",")]
    req = TuneRequest(
        model=path,
        objective="throughput",
        batches=batches,
        targets=args.targets.split(","),
        precisions=args.precisions.split(","),
        rounds=args.rounds,
        profile=False,
        concurrency_rounds=args.sweep_rounds,
        concurrency_round_s=args.sweep_round_s,
        spec_data=spec_data,
    )
    t0 = time.monotonic()
    report = tune_model(req, store=store)
    wall = time.monotonic() - t0
    rec = report.recommendation
    if rec is None:
        print(f"\n### {label}: no recommendation")
        return
    curve = rec["serving"]["curve"]
    timed = sum(c.passed for c in report.candidates)
    print(f"\n### {label}: throughput search (batch {args.batch})\n")
    print(
        f"search wall time {wall:.1f} s ({timed} candidates timed one request at a time, then the curve: "
        f"{len(curve['points'])} points × {curve['rounds']} rounds, requests per instance and round by batch "
        f"{curve['requests_per_instance']}); host alone: {curve['alone']}\n"
    )
    print(f"recommendation (one request at a time): {rec['id']}, {rec['throughput']:.0f} samples/s\n")
    print(f"curve of {curve['candidate']} (samples/s, median [95% interval] of {curve['rounds']} rounds):\n")
    print_curve(curve)
    pick = curve["pick"]
    print(
        f"\n- pick: batch {pick['batch']} × {pick['instances']} instances, {pick['throughput']:.0f} samples/s; "
        f"best of the sweep {curve['best_measured_throughput']:.0f}; pick/best = {curve['pick_vs_best']:.3f}; "
        f"{len(curve['tied_within_noise'])} other points within the noise of the pick"
        f"\n- vs one instance at batch {rec['batch']} (the one-request-at-a-time recommendation): "
        + _vs_single(curve, rec["batch"])
        + f"\n- Triton settings published: {rec['serving']['triton']}"
    )
    by_key = {c.key: c for c in report.candidates}
    fmt = next(b.artifact_format for b in report.built if b.target == rec["target"] and b.artifact_format)
    again = measure_concurrency(
        by_key[rec["id"]],
        fmt,
        load_spec({**spec_data, "targets": [rec["target"]]}),
        batches=batches,
        deadline=Deadline(None),
        rounds=args.sweep_rounds,
        min_round_s=args.sweep_round_s,
    )
    at_pick = next(p for p in again["points"] if (p["batch"], p["instances"]) == (pick["batch"], pick["instances"]))
    best = again["best_measured_throughput"]
    print(f"\nseparate sweep ({again['rounds']} rounds), same points:\n")
    print_curve(again)
    print(
        f"\n- the first sweep's pick in the separate sweep: {at_pick['throughput']:.0f} samples/s; best there "
        f"{best:.0f} (batch {again['pick']['batch']} × {again['pick']['instances']}); "
        f"ratio pick/best = {at_pick['throughput'] / best:.3f} (done-when: ≥ 0.9)"
    )


def _vs_single(curve: dict[str, Any], batch: int) -> str:
    one = next(p for p in curve["points"] if p["batch"] == batch and p["instances"] == 1)
    return f"{one['throughput']:.0f} samples/s; the pick is {curve['pick']['throughput'] / one['throughput']:.2f}×"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--recheck-rounds", type=int, default=200)
    parser.add_argument("--only", help="only the model whose label contains this")
    parser.add_argument("--targets", default="onnxruntime,openvino,tflite")
    parser.add_argument("--objective", choices=["latency", "throughput"], default="latency")
    parser.add_argument("--batch", default="1,8,32", help="throughput: the batch sizes searched")
    parser.add_argument("--precisions", default="fp32,fp16,int8")
    parser.add_argument("--sweep-rounds", type=int, default=7, help="throughput: rounds of each concurrency sweep")
    parser.add_argument("--sweep-round-s", type=float, default=0.05, help="throughput: one instance's round, about")
    args = parser.parse_args()

    from services.storage import LocalArtifactStore
    from services.tune import TuneRequest, tune_model

    print(f"cpus: {os.cpu_count()}; rounds: {args.rounds}; recheck rounds: {args.recheck_rounds}")
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as tmp:
        for label, path, spec_data in build_models(Path(tmp)):
            if args.only and args.only not in label:
                continue
            store = LocalArtifactStore(Path(tmp) / f"store-{label}")  # cold cache per model
            if args.objective == "throughput":
                throughput_run(label, path, store, args, spec_data)
                continue
            req = TuneRequest(
                model=path,
                targets=args.targets.split(","),
                precisions=args.precisions.split(","),
                rounds=args.rounds,
                profile=True,
                spec_data=spec_data,
            )
            t0 = time.monotonic()
            report = tune_model(req, store=store)
            wall = time.monotonic() - t0
            body = report.to_dict()
            rec = body["recommendation"]
            print(f"\n### {label}: search\n")
            print("| candidate | status | p50 ms | IQR ms | p99 ms | note |\n|---|---|---:|---:|---:|---|")
            for c in body["candidates"]:
                note = "**recommended**" if rec and c["id"] == rec["id"] else (c["reason"] or "")[:60]
                p50, iqr, p99 = (f"{c[k]:.3f}" if c[k] is not None else "-" for k in ("p50_ms", "iqr_ms", "p99_ms"))
                print(f"| {c['id']} | {c['status']} | {p50} | {iqr} | {p99} | {note} |")
            cache = body["cache"]
            timed = sum(c["passed"] for c in body["candidates"])
            print(
                f"\nsearch wall time {wall:.1f} s (build + {body['measurement']['rounds']} rounds + profiles); "
                f"{timed} candidates timed, {body['measurement'].get('left_the_race', 0)} left the race early; cache: {cache['steps_cached']} of {cache['steps']} steps reused "
                f"({cache['conversions_reused']} conversions reused, {cache['conversions_run']} run)"
            )
            for b in body["built"]:
                if b["status"] == "failed":  # the table cuts reasons short; a failed build's whole reason
                    print(f"failed build {b['target']} {b['precision']}: {json.dumps(b['error'])[:3000]}")
            if rec is None:
                print("no recommendation")
                continue
            print(f"recommendation: {rec['id']}; {rec['verdict']}")
            for role, prof in body["profiles"].items():
                if prof.get("available"):
                    top = ", ".join(f"{o['op_type']} {o['share']:.0%}" for o in prof["top_ops"][:4])
                    where = prof.get("time_by_exec_precision")
                    print(f"profile ({role}, {prof['candidate']}): {top}" + (f"; executed in {where}" if where else ""))
            r = recheck(report, args.recheck_rounds, spec_data)
            print(
                f"\n### {label}: separate re-timing ({args.recheck_rounds} rounds, {r['timed']} candidates + default)\n"
            )
            print(
                f"- recommendation {rec['id']}: p50 {r['rec'].p50_ms:.3f} ms (rank {r['rank']} of {r['timed']})\n"
                f"- fastest in the re-timing: {r['fastest'].key}, p50 {r['fastest'].p50_ms:.3f} ms; "
                f"recommendation within its noise: {r['within_noise']}"
                + (
                    f" (paired median diff {r['diff']['median_ms']:+.4f} ms, CI {r['diff']['ci_ms']})"
                    if r["diff"]
                    else ""
                )
                + f"\n- default fp32 onnxruntime artifact: p50 {r['default'].p50_ms:.3f} ms; "
                f"ratio recommendation/default = {r['ratio_vs_default']:.3f} (median of per-round ratios)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
