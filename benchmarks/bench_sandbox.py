"""The step sandbox's cost per step: the same steps through run_in_child, sandboxed and not, side by side.

Two processes (KILN_SANDBOX=auto and KILN_SANDBOX=off), each with its own forkserver, run the
same steps alternately so both see the same machine load:

- ``noop``: a step that writes one file (the pure per-step overhead: hand-over, the trusted
  side's fetch and output claim, JSON messages);
- ``optimize``: Kiln's real ONNX optimise step on the test suite's small CNN (onnxruntime);
- ``first``: the first step of a fresh child (what a retired child costs: fork, Landlock).

With ``--baseline DIR`` (a checkout of an earlier Kiln, e.g. ``git archive <commit> | tar -x -C DIR``)
a third process runs the same steps sandboxed with that code, interleaved with the others:
the sandbox's cost per step before and after a change, side by side on the same load.

Run: ``PYTHONPATH=. python benchmarks/bench_sandbox.py [--rounds 15] [--baseline DIR]``; results in
docs/benchmarks.md ("Step sandbox").
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_WORKER = r"""
import json, os, shutil, sys, time
from pathlib import Path
sys.path.insert(0, os.environ["KILN_BENCH_ROOT"])
from kiln_testing.models import tiny_cnn_onnx
from services.graph.planner import PlanStep
from services.settings import Settings
from services.storage import LocalArtifactStore
from workers import child
from workers.child import StepRequest, run_in_child

root = Path(sys.argv[1]); root.mkdir(parents=True, exist_ok=True)
settings = Settings(cache_dir=root / "cache", data_dir=root / "data", artifact_store=str(root / "store"), repository=str(root / "repo"))
store = LocalArtifactStore(root / "store")
up = root / "upload"; up.mkdir(exist_ok=True); tiny_cnn_onnx(up / "cnn.onnx"); store.put_dir("sources/cnn", up)
print(json.dumps({"protection": child.protection(settings).summary()}), flush=True)
n = 0
def step(entry, kind):
    global n
    n += 1
    s = PlanStep(id=f"{kind}-{n}", kind=kind, engine="onnxruntime", entry=entry, inputs={"model": "source"}, tool="bench")
    req = StepRequest(job_id=f"j{n}", step=s.to_dict(), spec={"targets": ["onnxruntime"], "benchmark": False},
                      source_key="sources/cnn", source_filename="cnn.onnx", input_keys={}, settings=settings,
                      scratch=root / "scratch" / str(n), use_cache=False)
    t = time.perf_counter(); res = run_in_child(req, soft_limit=300, hard_limit=360); dt = time.perf_counter() - t
    assert res.ok, res.error
    return dt
for line in sys.stdin:
    what = line.strip()
    if what == "first":
        child.shutdown_children()
        dt = step("jobs_support:ok_step", "convert")
    elif what == "noop":
        dt = step("jobs_support:ok_step", "convert")
    else:
        dt = step("services.passes.step:run_optimize_step", "optimize")
    print(json.dumps({what: dt}), flush=True)
"""


def _start(mode: str, root: Path, code: Path = ROOT, name: str = "") -> subprocess.Popen[str]:
    name = name or mode
    env = {
        **os.environ,
        "KILN_SANDBOX": mode,
        "PYTHONPATH": f"{code}:{code / 'tests'}",
        "KILN_BENCH_ROOT": str(code),
    }
    env["KILN_HOST_LOCK_DIR"] = str(root / f"locks-{name}")
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(root / name)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--baseline", type=Path, help="an earlier checkout: its sandboxed steps side by side")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kiln-bench-sandbox-"))
    procs = {m: _start(m, root) for m in ("auto", "off")}
    if args.baseline:
        procs["baseline"] = _start("auto", root, args.baseline.resolve(), "baseline")
    try:
        info = {m: json.loads(p.stdout.readline())["protection"] for m, p in procs.items()}  # type: ignore[union-attr]
        times: dict[str, dict[str, list[float]]] = {m: {"noop": [], "optimize": [], "first": []} for m in procs}
        for what in ["noop"] * 2 + ["optimize"]:  # warm both children (and onnxruntime) first
            for p in procs.values():
                p.stdin.write(what + "\n")
                p.stdin.flush()
                p.stdout.readline()  # type: ignore[union-attr]
        for _ in range(args.rounds):
            for what in ("noop", "optimize", "first"):
                for m, p in procs.items():
                    p.stdin.write(what + "\n")
                    p.stdin.flush()  # type: ignore[union-attr]
                    times[m][what].append(json.loads(p.stdout.readline())[what])  # type: ignore[union-attr]
    finally:
        for p in procs.values():
            p.stdin.close()  # type: ignore[union-attr]
            p.wait(60)
        shutil.rmtree(root, ignore_errors=True)
    print(f"sandboxed: {info['auto']}\nunsandboxed: {info['off']}")
    if "baseline" in procs:
        print(f"baseline ({args.baseline}): {info['baseline']}")
        print(
            f"{'step':10} {'sandboxed ms':>13} {'baseline ms':>12} {'difference':>11} {'unsandboxed ms':>15}"
            f"  (medians of {args.rounds}, interleaved)"
        )
        for what in ("noop", "optimize", "first"):
            a, b, o = (statistics.median(times[m][what]) * 1000 for m in ("auto", "baseline", "off"))
            print(f"{what:10} {a:13.1f} {b:12.1f} {a - b:+11.1f} {o:15.1f}")
        return
    print(
        f"{'step':10} {'sandboxed ms':>13} {'unsandboxed ms':>15} {'ratio':>6}  (medians of {args.rounds}, interleaved)"
    )
    for what in ("noop", "optimize", "first"):
        a, o = (statistics.median(times[m][what]) * 1000 for m in ("auto", "off"))
        print(f"{what:10} {a:13.1f} {o:15.1f} {a / o:6.2f}")


if __name__ == "__main__":
    main()
