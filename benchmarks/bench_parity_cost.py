"""What the verifier's checks cost per target, against the export step itself, side by side.

For each real model (kiln_testing/real_models.py) this compiles one onnxruntime and one
openvino artifact at fp32 (benchmark off), then times on the same reference outputs:

- the previous comparison (one flattened max-abs / cosine / top-1 over all samples, kept
  here as the baseline it was), and
- today's :func:`services.validation.compare_outputs` (per-sample cosine, Pearson, SNR,
  scale, bias, class-axis top-1 with the tie rule),
- the localisation a failing ONNX-family target gets (every intermediate tensor exposed on
  both sides, one sample),

interleaved round by round, medians of ``--rounds``; and prints each against the export
step's own time from the same job. ``--baseline DIR`` also times another checkout's
``measure_output`` (services/validation/metrics.py of that tree, loaded beside this one) on the
same outputs in the same rounds: the cost of a change to the metrics, side by side.

    python benchmarks/bench_parity_cost.py [--models a,b] [--rounds 7] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln_testing import real_models
from services.formats import Format
from services.pipeline import compile_model
from services.repository.local import LocalModelRepository
from services.runners import open_runner
from services.spec import DEFAULT_TOLERANCES, Precision, load_spec
from services.steps.reference import load_reference
from services.storage import LocalArtifactStore
from services.validation import compare_outputs
from services.validation.localize import localize_divergence

DEFAULT_MODELS = ("ppocr-v4-rec", "nudenet-320n", "minilm-l3-paraphrase")


def previous_comparison(actual: list[np.ndarray], expected: list[np.ndarray], atol: float, rtol: float) -> tuple:
    """The comparison before per-sample metrics: one flattened pass (the baseline)."""
    a = np.concatenate([np.asarray(x, dtype=np.float64).reshape(-1) for x in actual])
    b = np.concatenate([np.asarray(x, dtype=np.float64).reshape(-1) for x in expected])
    both = np.isfinite(a) & np.isfinite(b)
    fa, fb = a[both], b[both]
    diff = np.abs(fa - fb)
    cosine = float(np.dot(fa, fb) / (np.linalg.norm(fa) * np.linalg.norm(fb) or 1.0))
    top1 = None
    if all(np.asarray(y).ndim == 2 for y in expected):
        hits = [np.argmax(x, 1) == np.argmax(y, 1) for x, y in zip(actual, expected, strict=True)]
        top1 = float(np.concatenate(hits).mean())
    return float(diff.max()), cosine, bool(np.all(diff <= atol + rtol * np.abs(fb))), top1


def load_baseline_metrics(checkout: Path) -> Any:
    """Return another checkout's services/validation/metrics.py as a module of its own (its imports from this tree)."""
    path = checkout / "services" / "validation" / "metrics.py"
    spec = importlib.util.spec_from_file_location("baseline_metrics", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, root: Path, rounds: int, baseline: Any = None) -> list[dict[str, Any]]:
    model = real_models.get(name)
    path = real_models.fetch(model)
    feeds = real_models.realistic_inputs(model, path, n=32, seed=11)
    np.savez(root / f"{name}.npz", **feeds)
    first = model.inputs[0].name
    spec = load_spec(
        {
            "targets": ["onnxruntime", "openvino"],
            "name": name,
            "benchmark": False,
            "calibration": str(root / f"{name}.npz"),
            "inputs": {first: {"shape": [-1, *feeds[first].shape[1:]]}},
        }
    )
    result = compile_model(
        path, spec, store=LocalArtifactStore(root / "store"), repository=LocalModelRepository(root / "repo")
    )
    ref = load_reference(result.steps["reference"].artifact)
    tol = DEFAULT_TOLERANCES[Precision.FP32]
    rows = []
    for target, fmt, entry in (
        ("onnxruntime", Format.ONNX, "model.onnx"),
        ("openvino", Format.OPENVINO_IR, "model.xml"),
    ):
        t = result.targets[target]
        if t.status != "succeeded":
            print(f"{name} {target}: {t.error}", file=sys.stderr)
            continue
        art = Path(t.published["uri"].removeprefix("file://")) / entry
        runner = open_runner(fmt, art)
        actual = [runner.run({k: v for k, v in f.items()}) for f in ref.inputs]
        names = ref.output_names
        export_step = next(o for sid, o in result.steps.items() if sid.startswith(f"export:{target}"))
        fp32_onnx = next(o for sid, o in result.steps.items() if sid == "optimize").artifact.path

        def previous(actual: list = actual, names: list = names) -> list:
            return [
                previous_comparison([a[n] for a in actual], [e[n] for e in ref.outputs], tol.atol or 0, tol.rtol or 0)
                for n in names
            ]

        def metrics(actual: list = actual, names: list = names) -> list:
            return [compare_outputs(n, [a[n] for a in actual], [e[n] for e in ref.outputs], tol) for n in names]

        def localise(fp32_onnx: Path = fp32_onnx, art: Path = art, fmt: Format = fmt) -> Any:
            return localize_divergence(fp32_onnx, art, fmt, ref.inputs[0], tol)

        def baseline_metrics(actual: list = actual, names: list = names) -> list:
            return [
                baseline.measure_output(
                    [a[n] for a in actual],
                    [e[n] for e in ref.outputs],
                    atol=tol.atol,
                    rtol=tol.rtol,
                    min_snr_db=tol.min_snr_db,
                )
                for n in names
            ]

        old, new, loc, base = [], [], [], []
        for _ in range(rounds):  # interleaved: each round times all of them on the same load
            old.append(_timed(previous))
            new.append(_timed(metrics))
            if baseline is not None:
                base.append(_timed(baseline_metrics))
            loc.append(_timed(localise))
        rows.append(
            {
                "model": name,
                "target": target,
                "samples": ref.samples,
                "values": int(sum(np.asarray(e[n]).size for e in ref.outputs for n in names)),
                "export_s": export_step.seconds,
                "previous_ms": statistics.median(old) * 1e3,
                "metrics_ms": statistics.median(new) * 1e3,
                "localize_ms": statistics.median(loc) * 1e3,
                "baseline_ms": statistics.median(base) * 1e3 if base else None,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--baseline", type=Path, help="another checkout whose measure_output is timed beside this one's")
    args = ap.parse_args()
    baseline = load_baseline_metrics(args.baseline) if args.baseline else None
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-parity-cost-") as tmp:
        for name in [n for n in args.models.split(",") if n]:
            rows += measure(name, Path(tmp), args.rounds, baseline)
    print(
        "| model | target | samples | values compared | export step s | previous check ms | metrics ms (ratio) | localisation ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["metrics_ms"] / r["previous_ms"] if r["previous_ms"] else float("nan")
        print(
            f"| {r['model']} | {r['target']} | {r['samples']} | {r['values']:,} | {r['export_s']:.2f} | "
            f"{r['previous_ms']:.1f} | {r['metrics_ms']:.1f} ({ratio:.1f}x) | {r['localize_ms']:.0f} |"
        )
    if baseline is not None:
        print()
        print("| model | target | baseline checkout's metrics ms | this checkout's metrics ms | ratio |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['model']} | {r['target']} | {r['baseline_ms']:.1f} | {r['metrics_ms']:.1f} | "
                f"{r['metrics_ms'] / r['baseline_ms']:.2f} |"
            )


if __name__ == "__main__":
    main()
