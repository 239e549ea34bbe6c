"""Accuracy on labelled data (issue 28): plain int8 against accuracy-aware int8 on a real classifier.

Magika (kiln_testing/real_models.py) on files whose type is known by construction
(kiln_testing/labelled_data.py), compiled with ``evaluation.max_drop`` for onnxruntime and
openvino: fp32, plain int8 (``accuracy_aware_int8: false``; onnxruntime without auto_exclude)
and accuracy-aware int8 (the defaults: NNCF's accuracy control, onnxruntime's auto_exclude
judged by the metric). For each: the source's and the artifact's top-1, the drop, the verdict,
what stayed in float, parity's worst SNR on the held-out rows, the int8 artifact's p50 against
fp32 on the same engine (timed side by side, batch 1), and the compile's wall time.

    python benchmarks/bench_evaluation.py [--samples 240] [--calibration 64] [--max-drop 0.02]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kiln_testing import real_models  # noqa: E402
from kiln_testing.labelled_data import MAGIKA, magika_calibration, magika_files  # noqa: E402
from services.pipeline import compile_model  # noqa: E402
from services.repository import LocalModelRepository  # noqa: E402
from services.spec import load_spec  # noqa: E402
from services.storage import LocalArtifactStore  # noqa: E402

TARGETS = ("onnxruntime", "openvino")


def _row(name: str, target: str, result: Any, seconds: float) -> dict[str, Any]:
    t = result.targets[target]
    ev = t.evaluation or {}
    search = ev.get("int8_search") or {}
    snrs = [float(o["snr_db"]) for o in (t.parity or {}).get("outputs", []) if o.get("snr_db") is not None]
    vs = (t.vs_fp32 or {}).get("rows") or []
    return {
        "variant": name,
        "target": target,
        "status": t.status if t.status == "succeeded" else (t.error or {}).get("code", t.status),
        "source": ev.get("source"),
        "artifact": ev.get("artifact"),
        "drop": ev.get("drop"),
        "in_float": search.get("left_in_float", "-"),
        "snr": min(snrs) if snrs else None,
        "speedup": vs[0]["speedup"] if vs else None,
        "seconds": seconds,
    }


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float | int) and not isinstance(v, bool) else str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--calibration", type=int, default=64)
    parser.add_argument("--max-drop", type=float, default=0.02)
    args = parser.parse_args(argv)
    model = real_models.fetch(MAGIKA)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-evaluation-") as tmp:
        root = Path(tmp)
        x, labels = magika_files(model, args.samples)
        np.savez(root / "eval.npz", bytes=x, labels=labels)
        np.savez(root / "calib.npz", bytes=magika_calibration(model, args.calibration))
        store = LocalArtifactStore(root / "store")
        base = {
            "targets": list(TARGETS),
            "calibration": str(root / "calib.npz"),
            "benchmark": {"batch_sizes": [1], "iterations": 200, "warmup": 10},
        }
        evaluation = {"data": str(root / "eval.npz"), "metric": "top1", "max_drop": args.max_drop}
        variants = {
            "fp32": {"precision": "fp32", "evaluation": evaluation, "benchmark": False},
            "plain int8": {
                "precision": "int8",
                "evaluation": {**evaluation, "accuracy_aware_int8": False},
                "options": {"onnxruntime": {"int8": {"auto_exclude": False}}},
            },
            "accuracy-aware int8": {"precision": "int8", "evaluation": evaluation},
        }
        for i, (name, extra) in enumerate(variants.items()):
            spec = load_spec({**base, **extra, "name": f"magika-{i}"})
            started = time.perf_counter()
            result = compile_model(model, spec, store=store, repository=LocalModelRepository(root / "repo"))
            seconds = time.perf_counter() - started
            rows.extend(_row(name, target, result, seconds) for target in TARGETS)
    print(
        f"Magika, {args.samples} labelled files (12 kinds), {args.calibration} calibration rows, max_drop {args.max_drop}"
    )
    print()
    print("| variant | target | status | source top-1 | artifact top-1 | drop | left in float | worst SNR (dB) | int8 p50 speed-up vs fp32 | compile s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['target']} | {r['status']} | {_fmt(r['source'], '.4f')} | "
            f"{_fmt(r['artifact'], '.4f')} | {_fmt(r['drop'], '.4f')} | {r['in_float']} | {_fmt(r['snr'], '.1f')} | "
            f"{_fmt(r['speedup'], '.2f')} | {r['seconds']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
