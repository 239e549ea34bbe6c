"""Run every benchmark script in turn (``make benchmarks``); each prints its own markdown tables.

The results are read by a person and written into docs/benchmarks.md with the machine's
load at the time: these machines are shared, so only ratios from one run mean anything.
A script that fails does not stop the others; the exit status says whether any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: In the order docs/benchmarks.md reports them.
SCRIPTS = (
    "bench_optimizer.py",
    "bench_skip_layernorm.py",
    "bench_ort_fusions.py",
    "bench_openvino.py",
    "bench_tflite.py",
    "bench_torch_sources.py",
    "bench_ncnn.py",
    "bench_tensorrt_preflight.py",
    "bench_mnn.py",
    "bench_tvm.py",
    "bench_parity_bounds.py",  # fetches real models from PyPI (kiln_testing/real_models.py)
    "bench_parity_cost.py",
    "bench_tune.py",
    "bench_service.py",  # needs Redis and PostgreSQL on loopback, and wrk
    "bench_dashboard.py",  # needs Redis and PostgreSQL on loopback, and wrk
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", action="append", help="run only scripts whose name contains this (repeatable)")
    args = parser.parse_args()
    chosen = [s for s in SCRIPTS if not args.only or any(o in s for o in args.only)]
    failed: list[str] = []
    for script in chosen:
        print(f"\n<!-- {script} -->", flush=True)
        started = time.monotonic()
        rc = subprocess.call([sys.executable, str(HERE / script)])
        print(f"<!-- {script}: exit {rc} after {time.monotonic() - started:.0f} s -->", flush=True)
        if rc != 0:
            failed.append(script)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
