"""Time and peak memory of `kiln compile` of a Keras ResNet-50 to four targets: this checkout against another.

    .venv/bin/python benchmarks/bench_compile_cost.py --baseline DIR [--size 96] [--runs 1]

The model is ``keras.applications.ResNet50(weights=None)`` (25.6 M parameters, 1000 classes)
on a ``--size`` x ``--size`` RGB input, its BatchNorm statistics set from one batch of random
images so that parity compares meaningful numbers (fp16 bounds loosened to cosine 0.99,
top-1 50%: an untrained network's logits are too close together for the defaults). Each run is one ``kiln compile`` to
onnxruntime, openvino, tflite and tfserving at fp16 with an empty cache (``--no-cache``)
and no latency benchmark; the two checkouts alternate (baseline first). Per run the script
records the wall time and the peak of the summed RSS over the CLI process and all its
descendants (sampled every 50 ms with psutil, so a child's memory counts while it lives).
``ru_maxrss`` is not used: since each step resets the process's high-water mark to measure
its own peak, the kernel's lifetime figure is gone in this checkout. For this checkout it
also prints the per-step breakdown (seconds and the step's process peak RSS) that the
steps' lineage records (and so the manifests) carry since ``services.pipeline.memory``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILN = ROOT / ".venv" / "bin" / "kiln"
TARGETS = ("onnxruntime", "openvino", "tflite", "tfserving")
MIB = 1 << 20


def make_model(path: Path, size: int) -> None:
    """Save ResNet50(weights=None) with BatchNorm statistics of random images (as kiln_testing/tf_models.py does)."""
    import numpy as np

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    keras.utils.set_random_seed(3)  # the same network every time: parity's pass or fail is then fixed
    model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3))
    norms = [la for la in model.layers if isinstance(la, keras.layers.BatchNormalization)]
    batch = np.random.default_rng(3).standard_normal((8, size, size, 3)).astype("float32")
    for layer in norms:
        layer.momentum = 0.0
    model(batch, training=True)
    for layer in norms:
        layer.momentum = 0.99
    model.save(path)


class TreeSampler(threading.Thread):
    """Sample the summed RSS of a process and its descendants until it exits."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak = pid, interval, 0
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self.done.is_set():
            total = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self.done.wait(self.interval)


def compile_once(model: Path, work: Path, tree: Path | None) -> dict[str, object]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = str(tree or ROOT)
    # A freshly initialised ResNet-50's 1000 logits are close together, so fp16 rounding
    # reaches cosine ~0.996 (precision default 0.999): looser bounds, so every target's whole
    # route runs and publishes; what is measured is the compile's cost, not its accuracy.
    spec = work / "spec.json"
    spec.write_text(json.dumps({"tolerances": {"min_cosine": 0.99, "min_top1": 0.5}}))
    cmd = [str(KILN), "compile", str(model), "--spec", str(spec), "-p", "fp16", "--no-cache", "--no-benchmark"]
    cmd += ["--json", "-q"]
    for t in TARGETS:
        cmd += ["-t", t]
    cmd += ["--repo", str(work / "repo"), "--name", "resnet50", "--cache-dir", str(work / "cache")]
    started = time.perf_counter()
    with open(work / "out.json", "wb") as out, open(work / "err.log", "wb") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        _, status = os.waitpid(proc.pid, 0)
        seconds = time.perf_counter() - started
        sampler.done.set()
        sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    result = json.loads((work / "out.json").read_text() or "{}")
    targets = {
        t: r.get("status") if r.get("status") == "succeeded" else (r.get("error") or {}).get("code")
        for t, r in (result.get("targets") or {}).items()
    }
    steps: dict[str, dict[str, object]] = {}
    # Every stored step output carries the lineage records of the steps before it (what the
    # manifests copy), so failed targets' steps are in the breakdown too.
    for descriptor in sorted((work / "cache" / "store").rglob("kiln-artifact.json")):
        for rec in json.loads(descriptor.read_text()).get("meta", {}).get("lineage", []):
            steps[rec["step"]] = rec
    return {
        "seconds": seconds,
        "tree_peak": sampler.peak,
        "rc": proc.returncode,
        "targets": targets,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout (its code runs via PYTHONPATH)")
    parser.add_argument("--size", type=int, default=96, help="input height and width (224 is ResNet-50's own)")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-compile-cost-") as tmp:
        root = Path(tmp)
        model = root / "resnet50.keras"
        make_model(model, args.size)
        runs: dict[str, list[dict[str, object]]] = {"baseline": [], "this": []}
        for i in range(args.runs):
            for label, tree in (("baseline", args.baseline.resolve()), ("this", None)):
                work = root / f"{label}-{i}"
                work.mkdir()
                runs[label].append(compile_once(model, work, tree))
                shutil.rmtree(work)
                r = runs[label][-1]
                print(
                    f"{label} run {i}: {r['seconds']:.1f} s, tree peak {r['tree_peak'] / MIB:.0f} MiB, "
                    f"rc {r['rc']}, targets {r['targets']}",
                    file=sys.stderr,
                )

        def med(label: str, key: str) -> float:
            return statistics.median(float(r[key]) for r in runs[label])  # type: ignore[arg-type]

        print(f"ResNet50(weights=None) {args.size}x{args.size}, fp16, {', '.join(TARGETS)}; {args.runs} run(s) each\n")
        print("| measure | baseline (median) | this (median) | this / baseline |")
        print("|---|---:|---:|---:|")
        for key, name, scale, unit in (
            ("seconds", "wall time", 1, "s"),
            ("tree_peak", "peak RSS, CLI + children (sum)", MIB, "MiB"),
        ):
            b, t = med("baseline", key), med("this", key)
            print(f"| {name} | {b / scale:.1f} {unit} | {t / scale:.1f} {unit} | {t / b:.2f} |")
        for label in runs:
            print(f"\n{label} targets: {runs[label][-1]['targets']}")
        last = runs["this"][-1]["steps"]
        print("\nPer step (this checkout, last run; peak = the step's process while the step ran):\n")
        print("| step | engine | seconds | RSS before MiB | peak RSS MiB |")
        print("|---|---|---:|---:|---:|")
        for sid, rec in last.items():  # type: ignore[attr-defined]
            print(
                f"| {sid} | {rec.get('engine')} | {rec.get('seconds')} | {rec.get('rss_before_mb', '')} "
                f"| {rec.get('peak_rss_mb')} |"
            )
        print(f"\nload average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())} (2 cores, shared)")


if __name__ == "__main__":
    sys.exit(main())
