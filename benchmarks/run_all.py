"""Run every benchmark script in turn (``make benchmarks``); each prints its own markdown tables.

The results are read by a person and written into docs/benchmarks.md with the machine's
load at the time: these machines are shared, so only ratios from one run mean anything.
A script that fails does not stop the others; the exit status says whether any failed.

Every ``bench_*.py`` here is in ``SCRIPTS`` with the arguments it runs with (its defaults, or
the short ones docs/benchmarks.md records); tests/test_benchmark_scripts.py fails when one is
missing. ``--list`` prints them without running anything. The scripts that compare two
checkouts (``--baseline``) compare this one with itself unless ``--baseline DIR`` is given.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: Stands for the checkout to compare with in a script's arguments.
BASELINE = "{baseline}"


@dataclass(frozen=True)
class Script:
    """One benchmark script, the arguments ``make benchmarks`` runs it with, and what it needs."""

    name: str
    args: tuple[str, ...] = ()
    #: Beyond this venv and its engines: servers, tools, the network.
    needs: str = ""


#: In the order docs/benchmarks.md reports them.
SCRIPTS: tuple[Script, ...] = (
    Script("bench_optimizer.py", ("--rounds", "9", "--seconds", "0.3")),
    Script("bench_skip_layernorm.py", ("--rounds", "7", "--seconds", "0.15")),
    Script("bench_ort_fusions.py", ("--rounds", "7", "--seconds", "0.2")),
    Script("bench_openvino.py", ("--rounds", "9", "--seconds", "0.4")),
    Script("bench_tflite.py"),
    Script("bench_torch_sources.py", ("--rounds", "5", "--seconds", "0.3")),
    Script("bench_ncnn.py"),
    Script("bench_tensorrt_preflight.py"),
    Script("bench_mnn.py", ("--rounds", "5", "--seconds", "0.3")),
    Script("bench_tvm.py"),
    Script("bench_int4.py"),
    Script("bench_onnx2tf.py"),
    Script("bench_route_matrix.py"),
    Script("bench_modern_matrix.py"),
    Script("bench_alone.py", ("--rounds", "3", "--iterations", "60")),
    Script("bench_onnx_backend.py", ("--kinds", "none", "--node")),
    Script("bench_parity_bounds.py", needs="PyPI (real models, kiln_testing/real_models.py)"),
    Script("bench_parity_cost.py", ("--rounds", "5"), needs="PyPI (real models)"),
    Script("bench_real_model_targets.py", needs="PyPI (real models)"),
    Script("bench_false_accepts.py", needs="PyPI (real models)"),
    Script("bench_ort_int8.py", needs="PyPI (real models)"),
    Script("bench_evaluation.py", needs="PyPI (real models)"),
    Script("bench_tune.py"),
    Script("bench_sandbox.py"),
    Script("bench_large_model.py", ("--baseline", BASELINE, "--mib", "512", "--runs", "3")),
    Script("bench_compile_cost.py", ("--baseline", BASELINE, "--size", "64", "--runs", "3")),
    Script("bench_light_start.py", needs="PyPI (installs the demo extras into a new venv)"),
    Script("bench_client_install.py", needs="PyPI (installs kiln_client into a new venv)"),
    Script("bench_cold_start.py"),
    Script("bench_service.py", needs="Redis and PostgreSQL on loopback, and wrk"),
    Script("bench_dashboard.py", needs="Redis and PostgreSQL on loopback, and wrk"),
    Script("bench_scaling.py", needs="Redis and PostgreSQL on loopback"),
    Script("bench_soak.py", needs="PostgreSQL on loopback (starts its own Redis)"),
)


def command(script: Script, baseline: Path) -> list[str]:
    """Return the argv that runs ``script`` with this interpreter."""
    args = [str(baseline) if a == BASELINE else a for a in script.args]
    return [sys.executable, str(HERE / script.name), *args]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", action="append", help="run only scripts whose name contains this (repeatable)")
    parser.add_argument("--list", action="store_true", help="print each script with its arguments; run nothing")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=ROOT,
        help="the checkout the --baseline scripts compare with (default: this one)",
    )
    args = parser.parse_args()
    chosen = [s for s in SCRIPTS if not args.only or any(o in s.name for o in args.only)]
    if args.list:
        for s in chosen:
            line = " ".join([s.name, *s.args])
            print(f"{line}  # needs {s.needs}" if s.needs else line)
        return 0
    failed: list[str] = []
    for script in chosen:
        print(f"\n<!-- {' '.join([script.name, *script.args])} -->", flush=True)
        started = time.monotonic()
        rc = subprocess.call(command(script, args.baseline.resolve()), cwd=ROOT)
        print(f"<!-- {script.name}: exit {rc} after {time.monotonic() - started:.0f} s -->", flush=True)
        if rc != 0:
            failed.append(script.name)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
